"""FP8 (E4M3) linear layers on CUDA: Triton kernels around torch._scaled_mm.

- `quantize_rows`: one launch per matmul for the dynamic per-token activation scales (amax, divide,
  cast), where the op-by-op path launched four: with ~130 FP8 linears in an 8B model, a decode
  step's graph carried ~500 extra kernels, and batch 1 ran slower in FP8 than in bf16.
- `weight_only_matmul`: few rows (small decode batches) are bound by reading the weights, not by
  multiplying them. There, the weights are read as FP8 and widened to fp16 in registers, as are the
  activations (exactly, for bf16 values from 2^-10 to about 1e6: ACTIVATION_PRESCALE): half the
  bytes of bf16, and no activation quantization to FP8. More rows go through `quantize_rows` and
  one FP8 tensor-core matmul instead.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from app.engine.models.kernels import FP8, FP8_MAX


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, width, stride_x, stride_q, FP8_MAX: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, width, BLOCK):
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < width, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0), 1e-12) / FP8_MAX
    tl.store(scale_ptr + row, scale)
    for start in range(0, width, BLOCK):
        mask = start + cols < width
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + start + cols, (x / scale).to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x / scale in FP8 [M, K], scale [M, 1] float32), scale = the row's amax / 448:
    the same arithmetic as the op-by-op path, in one launch."""
    rows, width = x.shape
    q = torch.empty(rows, width, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = min(triton.next_power_of_2(width), 4096)
        _quantize_rows_kernel[(rows,)](x, q, scale, width, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX, BLOCK=block,
                                       num_warps=8 if block >= 2048 else 4)
    return q, scale


@triton.jit
def _weight_only_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, rows, outs, width, stride_x, stride_w,
                        stride_out, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                        PRESCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    k = split * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + m[:, None].to(tl.int64) * stride_x + k[None, :]
    w_ptrs = w_ptr + n[None, :].to(tl.int64) * stride_w + k[:, None]  # [BLOCK_K, BLOCK_N] tile of w.T
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in range(split * BLOCK_K, width, BLOCK_K * SPLIT_K):
        x_mask = m[:, None] < rows
        w_mask = n[None, :] < outs
        if not EVEN_K:
            x_mask &= start + tl.arange(0, BLOCK_K)[None, :] < width
            w_mask &= start + tl.arange(0, BLOCK_K)[:, None] < width
        x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32) * PRESCALE
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        x = tl.clamp(x, -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL)
        acc = tl.dot(x.to(tl.float16), w.to(tl.float16), acc)
        x_ptrs += BLOCK_K * SPLIT_K
        w_ptrs += BLOCK_K * SPLIT_K
    acc *= 1.0 / PRESCALE
    mask = (m[:, None] < rows) & (n[None, :] < outs)
    if SPLIT_K == 1:
        acc *= tl.load(scale_ptr + n, mask=n < outs, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n < outs, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + m[:, None].to(tl.int64) * stride_out + n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # partial sums [SPLIT_K, rows, outs] in float32, finished by _finish_splits_kernel
        out = out_ptr + (split * rows + m[:, None]).to(tl.int64) * outs + n[None, :]
        tl.store(out, acc, mask=mask)


@triton.jit
def _finish_splits_kernel(partial_ptr, scale_ptr, bias_ptr, out_ptr, rows, outs, stride_out, SPLIT_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < outs
    acc = tl.zeros((BLOCK,), tl.float32)
    for split in range(SPLIT_K):
        acc += tl.load(partial_ptr + (split * rows + row).to(tl.int64) * outs + n, mask=mask, other=0.0)
    acc *= tl.load(scale_ptr + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


# An activation is scaled by 2^-4 before it becomes fp16, and the sum by 2^4 after: every bf16 value from
# 2^-10 to about 1e6 then converts exactly (bf16's 8 significant bits fit in fp16's 11); smaller ones round
# by at most 2^-21, no more than bf16 itself rounds values from 2^-13 up; larger ones and infinities
# saturate (the largest activations reported in LLMs are near 1e4); NaN stays NaN. float32 activations
# keep 11 significant bits, as TF32 dots would. fp16 activations convert as they are.
ACTIVATION_PRESCALE = 2.0 ** -4


def weight_only_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None, block_n: int = 128, block_k: int = 128, split_k: int = 1,
                       num_warps: int = 4, num_stages: int = 5) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] FP8 * weight_scale [1, N]).T (+ bias) -> [M, N] in x's dtype, the dots in
    fp16: E4M3 widens to fp16 exactly in one conversion per two values, and to bf16 only through fp16
    with one more per value. In the wide tiles of `weight_only_launch` that reads gate/up at 3.5 TB/s
    on an H200; bf16 dots read it slower in those tiles than in narrow ones, where they stopped at
    2.7 (docs/PERFORMANCE.md).
    split_k > 1 spreads each output tile's K over that many programs (a narrow layer otherwise leaves
    SMs idle), then one more launch sums them."""
    rows, width = x.shape
    outs = weight.shape[0]
    out = torch.empty(rows, outs, dtype=x.dtype, device=x.device)
    if not rows:
        return out
    bias_arg = bias if bias is not None else weight_scale  # not read without HAS_BIAS
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    grid = (triton.cdiv(outs, block_n), triton.cdiv(rows, block_m), split_k)
    target = out if split_k == 1 else torch.empty(split_k, rows, outs, dtype=torch.float32, device=x.device)
    prescale = 1.0 if x.dtype == torch.float16 else ACTIVATION_PRESCALE
    _weight_only_kernel[grid](x, weight, weight_scale, bias_arg, target, rows, outs, width, x.stride(0),
                              weight.stride(0), out.stride(0), SPLIT_K=split_k, HAS_BIAS=bias is not None,
                              EVEN_K=width % block_k == 0, PRESCALE=prescale, BLOCK_M=block_m, BLOCK_N=block_n,
                              BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    if split_k > 1:
        block = 1024
        _finish_splits_kernel[(rows, triton.cdiv(outs, block))](target, weight_scale, bias_arg, out, rows, outs,
                                                                out.stride(0), SPLIT_K=split_k,
                                                                HAS_BIAS=bias is not None, BLOCK=block)
    return out


WEIGHT_ONLY_ROWS = 32  # up to here the weight-only kernel beats quantize_rows + _scaled_mm (H200, docs/PERFORMANCE.md)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


WEIGHT_ONLY_TILE = 128  # outputs a program computes
LONG_K = 8192  # between the two widths measured: 4,096 (q/k/v, o) and 14,336 (down)


def weight_only_launch(outs: int, width: int, device: torch.device) -> dict:
    """The launch measured best on an H200 (tools/bench/kernels.py --only fp8). A layer with at least as
    many tiles as SMs (gate/up) reads blocks of 256 of K over 3 stages, unsplit. A narrower one splits
    K over several programs, never more than two per SM, in blocks of 128 over 5 stages: up to 8 for
    a long K (down's 14,336 read 0.5-3.4 us faster with 8 than with 4), else up to 4 (o's K of 4,096,
    with as many tiles as down, gained nothing from 8; q/k/v lost 2 us at 1-16 rows)."""
    tiles = triton.cdiv(outs, WEIGHT_ONLY_TILE)
    if tiles >= _multiprocessors(device):
        return dict(block_n=WEIGHT_ONLY_TILE, block_k=256, split_k=1, num_stages=3)
    most = 8 if width >= LONG_K else 4
    return dict(block_n=WEIGHT_ONLY_TILE, block_k=128,
                split_k=min(most, triton.cdiv(2 * _multiprocessors(device), tiles)), num_stages=5)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] FP8 * weight_scale [1, N]).T (+ bias), in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= WEIGHT_ONLY_ROWS:
        y = weight_only_matmul(rows.contiguous(), weight, weight_scale, bias,
                               **weight_only_launch(*weight.shape, x.device))
    else:
        q, scale = quantize_rows(rows)
        y = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=x.dtype)
        if bias is not None:  # _scaled_mm takes no bias with per-row scales
            y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])
