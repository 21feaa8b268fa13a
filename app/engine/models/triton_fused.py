"""Elementwise work of a decoder layer fused into single Triton kernels (CUDA): at small batch a
decode step is bounded by how many kernels it launches, not by their bytes (docs/PERFORMANCE.md:
rotary alone was ten kernels per layer, the cache writes two more, SiLU * up two).

- `rotary_store`: rotates q and k in place (rotate-half RoPE with the step's cos/sin rows) and
  writes k and v into their cache slots: one launch instead of twelve. An FP8 cache takes them
  divided by the layer's scales, and qkv keeps them as stored (rounded through E4M3).
- `silu_mul`: SiLU(gate) * up from the merged gate/up output: one launch instead of two.
- `add_rms_norm`: the residual add and the next RMSNorm: one launch instead of two, and the sum
  is read once.
All compute in float32 and round once, which is exact in float32 and within bf16 rounding of the
unfused path in 16-bit. Each also takes the LoRA delta (float32) of the projection it reads, where
a CUDA graph computed that beside the base matmul (lora.SlotBatch.beside), and rounds it into its
input as `y.add_(delta)` would: one launch fewer per adapted module.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_store_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                         delta_ptr, stride_t, stride_rope, stride_delta, NUM_HEADS: tl.constexpr,
                         NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, FP8: tl.constexpr, HAS_DELTA: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads, then v heads of this token
    d = tl.arange(0, HALF)
    base = qkv_ptr + token * stride_t + head * 2 * HALF
    x1 = tl.load(base + d)
    x2 = tl.load(base + HALF + d)
    if HAS_DELTA:
        deltas = delta_ptr + token * stride_delta + head * 2 * HALF
        x1 = _add_delta(x1, deltas + d, d < HALF)
        x2 = _add_delta(x2, deltas + HALF + d, d < HALF)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if head < NUM_HEADS + NUM_KV_HEADS:
        cos = tl.load(cos_ptr + token * stride_rope + d).to(tl.float32)  # both halves of the row are equal
        sin = tl.load(sin_ptr + token * stride_rope + d).to(tl.float32)
        y1 = (x1 * cos - x2 * sin).to(qkv_ptr.dtype.element_ty)
        y2 = (x2 * cos + x1 * sin).to(qkv_ptr.dtype.element_ty)
        if head >= NUM_HEADS:
            cache = k_cache_ptr + slot * NUM_KV_HEADS * 2 * HALF + (head - NUM_HEADS) * 2 * HALF
            if FP8:
                y1, y2 = _store_fp8(cache, d, HALF, y1, y2, k_scale_ptr)
            else:
                tl.store(cache + d, y1)
                tl.store(cache + HALF + d, y2)
        tl.store(base + d, y1)
        tl.store(base + HALF + d, y2)
    else:
        cache = v_cache_ptr + slot * NUM_KV_HEADS * 2 * HALF + (head - NUM_HEADS - NUM_KV_HEADS) * 2 * HALF
        y1, y2 = x1.to(qkv_ptr.dtype.element_ty), x2.to(qkv_ptr.dtype.element_ty)
        if FP8:
            y1, y2 = _store_fp8(cache, d, HALF, y1, y2, v_scale_ptr)
        else:
            tl.store(cache + d, y1)
            tl.store(cache + HALF + d, y2)
        if FP8 or HAS_DELTA:  # v as attention reads it from qkv
            tl.store(base + d, y1)
            tl.store(base + HALF + d, y2)


@triton.jit
def _add_delta(x, delta_ptrs, mask):
    """x + the LoRA delta at delta_ptrs, in float32, rounded to x's dtype as an in-place add rounds."""
    return (x.to(tl.float32) + tl.load(delta_ptrs, mask=mask, other=0.0)).to(x.dtype)


@triton.jit
def _store_fp8(cache, d, HALF: tl.constexpr, y1, y2, scale_ptr):
    """Stores y / scale in the cache's E4M3 (in float32, saturating at +-448) and returns y as the
    cache holds it, in y's dtype: what the step's own attention reads, as later steps will."""
    scale = tl.load(scale_ptr)
    fp8 = cache.dtype.element_ty
    q1 = tl.minimum(tl.maximum(y1.to(tl.float32) / scale, -448.0), 448.0).to(fp8)
    q2 = tl.minimum(tl.maximum(y2.to(tl.float32) / scale, -448.0), 448.0).to(fp8)
    tl.store(cache + d, q1)
    tl.store(cache + HALF + d, q2)
    return (q1.to(tl.float32) * scale).to(y1.dtype), (q2.to(tl.float32) * scale).to(y2.dtype)


def rotary_store(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None, delta: torch.Tensor | None = None):
    """qkv: [T, (H + 2 KVH) * D], rotated in place; cos, sin: [T, 1, D]; caches [blocks, block_size, KVH, D]
    (contiguous); kv_scales: an FP8 cache's key and value scales, by which k and v are divided as
    they are stored; delta: a LoRA delta [T, (H + 2 KVH) * D] float32, added to qkv first. Returns the
    views q [T, H, D], k, v [T, KVH, D], k and v as the cache holds them."""
    t, head_dim = qkv.shape[0], k_cache.shape[-1]
    if t:
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        k_scale, v_scale = kv_scales if fp8 else (k_cache, v_cache)  # not read without FP8
        _rotary_store_kernel[(t, num_heads + 2 * num_kv_heads)](
            qkv, cos, sin, slots, k_cache, v_cache, k_scale, v_scale, _or(delta, qkv), qkv.stride(0),
            cos.stride(0), _stride(delta), NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
            FP8=fp8, HAS_DELTA=delta is not None)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)


@triton.jit
def _silu_mul_kernel(x_ptr, delta_ptr, out_ptr, width, stride_x, stride_delta, stride_out, BLOCK: tl.constexpr,
                     HAS_DELTA: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        gate = _add_delta(gate, delta_ptr + row * stride_delta + cols, mask)
        up = _add_delta(up, delta_ptr + row * stride_delta + width + cols, mask)
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """[T, 2 I] (gate then up) -> SiLU(gate) * up, [T, I]; delta: a LoRA delta [T, 2 I] float32, added first."""
    t, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, width, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = 1024
        _silu_mul_kernel[(t, triton.cdiv(width, block))](gate_up, _or(delta, gate_up), out, width, gate_up.stride(0),
                                                         _stride(delta), out.stride(0), BLOCK=block,
                                                         HAS_DELTA=delta is not None)
    return out


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, residual_ptr, weight_ptr, out_ptr, width, eps, stride_x, stride_delta,
                         stride_r, stride_out, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        x = _add_delta(x, delta_ptr + row * stride_delta + cols, mask)
    x = x.to(tl.float32)
    r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    # The sum is rounded to the stream's dtype before it is normalised, as the unfused add would be.
    total = (x + r).to(residual_ptr.dtype.element_ty)
    tl.store(residual_ptr + row * stride_r + cols, total, mask=mask)
    h = total.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, 0) / width + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (h * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta: torch.Tensor | None = None) -> torch.Tensor:
    """residual += x (in place); returns RMSNorm(residual) * weight. x, residual: [T, hidden]; delta: a
    LoRA delta of x [T, hidden] float32, added to x first."""
    t, width = residual.shape
    out = torch.empty_like(residual)
    if t:
        block = triton.next_power_of_2(width)
        _add_rms_norm_kernel[(t,)](x, _or(delta, x), residual, weight, out, width, eps, x.stride(0), _stride(delta),
                                   residual.stride(0), out.stride(0), BLOCK=block,
                                   num_warps=min(16, max(1, block // 512)), HAS_DELTA=delta is not None)
    return out


def _or(delta: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """A pointer for the kernel's delta argument, never read without one."""
    return placeholder if delta is None else delta


def _stride(delta: torch.Tensor | None) -> int:
    assert delta is None or delta.stride(1) == 1, "a LoRA delta is laid out as the projection's output"
    return 0 if delta is None else delta.stride(0)
