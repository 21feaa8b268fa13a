"""Paged decode attention for CUDA as a Triton kernel: one program per (sequence, KV head) walks
that sequence's blocks with an online softmax, reading only the blocks it owns, and handles every
query head of the KV head's group in one tile (GQA). Each iteration reads a tile of context tokens
(its size set per launch, below), spanning several cache blocks when blocks are small, so more
bytes are in flight per program. Its inputs are tensors only (block tables, context lengths), so
decode steps can be captured in CUDA graphs.

With a sliding window a sequence attends to its last `window` keys (its newest included): the walk
starts at the tile holding the first of them, so blocks wholly before the window are never read,
and positions before it in that tile are masked. Softcapping (Gemma 2) applies tanh(s / cap) * cap
to the scaled scores, before the online softmax.

An FP8 cache's tiles are widened to fp16, which holds every E4M3 value exactly and is one
instruction per pair on Hopper (bf16 takes several): the dots run in fp16, the query multiplied by
the attention scale before its rounding to fp16 so it keeps its range. The per-layer scales are
applied once each: k_scale to the scores, v_scale to the output (sum p * (v8 * s) = s * sum p * v8).
They are read from device memory, as graphs need. (A float32 query keeps float32 dots.)

How a launch is shaped depends on how many programs it has. With thousands (hundreds of sequences),
every SM already holds several, so smaller tiles waste less on each context's last, partial tile and
fewer pipeline stages leave room for more programs; with few, each program must keep more bytes in
flight. Short contexts gain most from small tiles, but a graph is captured before the contexts are
known, so the number of programs decides. tools/bench/kernels.py (`--only decode`) times the choices.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

TILE_BYTES = 64 << 10  # at most per key (and value) tile: 128 tokens of float32 heads of 256 overran shared memory
MANY_PROGRAMS = 2048  # sequences x KV heads from which a launch takes the many-programs shape (256 sequences of 8B)


def launch_shape(programs: int, fp8: bool) -> tuple[int, int, int]:
    """(context tokens per tile, warps, pipeline stages) for a launch of `programs` programs. Measured on
    an H200, 8B shape (PERFORMANCE.md, "The decode kernel's launch shape")."""
    if fp8:
        return (64, 2, 2) if programs >= MANY_PROGRAMS else (128, 4, 2)
    return (128, 4, 2) if programs >= MANY_PROGRAMS else (128, 4, 3)


# The table's row stride is the widest table of the step: eager mixed steps pass any width, graphs
# a fixed one. Triton compiles a variant per class of an int (1, a multiple of 16, any other): the
# first eager mixed step compiled another mid-serving (662 ms against ~150 on an H200, 8B shape).
@triton.jit(do_not_specialize=["stride_tb"])
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, k_scale_ptr, v_scale_ptr, scale, window,
                         stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_tb, stride_ot, stride_oh,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr,
                         FP8: tl.constexpr, F16: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context = tl.load(lens_ptr + seq)
    first = tl.maximum(context - window, 0)  # the window's first position; the first tile always holds one
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)  # a power of 2: head dims that are not (Phi-3's 96) are padded with zeros
    in_head = d < HEAD_DIM
    n = tl.arange(0, TILE)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=(g < GROUP)[:, None] & in_head[None, :], other=0.0)
    if F16:  # q becomes fp16, and the tiles below widen to q's dtype
        q = (q.to(tl.float32) * scale).to(tl.float16)
        scale = tl.load(k_scale_ptr)
    elif FP8:
        scale = scale * tl.load(k_scale_ptr)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for i in range(first // TILE, tl.cdiv(context, TILE)):
        pos = i * TILE + n
        valid = (pos >= first) & (pos < context)
        block = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offsets = block[:, None] * stride_cb + (pos % BLOCK_SIZE)[:, None] * stride_cs + kv_head * stride_ch \
            + d[None, :]
        k = tl.load(k_ptr + offsets, mask=valid[:, None] & in_head[None, :], other=0.0).to(q.dtype)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        if SOFTCAP > 0:
            scores = libdevice.tanh(scores / SOFTCAP) * SOFTCAP
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offsets, mask=valid[:, None] & in_head[None, :], other=0.0).to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / total[:, None]
    if FP8:
        out = out * tl.load(v_scale_ptr)
    tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(g < GROUP)[:, None] & in_head[None, :])


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None = None, softcap: float | None = None,
                 kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None,
                 shape: tuple[int, int, int] | None = None) -> torch.Tensor:
    """q: [B, H, D]; caches: [num_blocks, block_size, KVH, D]; block_tables: [B, max_blocks] (int32);
    context_lens: [B] (int32); window: keys each sequence attends to, its newest included (None: all);
    kv_scales: an FP8 cache's key and value scales (float32, one element each); shape: (tile tokens, warps,
    stages) in place of launch_shape's (the benchmark's sweep). Returns [B, H, D] (in `out`, contiguous rows
    of q's shape, where one is given)."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    tile_tokens, num_warps, num_stages = shape or launch_shape(num_seqs * num_kv_heads, fp8)
    # The tiles as the dots read them: at most 4 bytes an element (a float32 query's).
    tile = min(max(tile_tokens, block_size), TILE_BYTES // (block_d * q.element_size()))
    out = torch.empty_like(q) if out is None else out
    k_scale, v_scale = kv_scales if fp8 else (out, out)  # not read without FP8
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, k_scale, v_scale, scale, window or 2 ** 31 - 1,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_SIZE=block_size, TILE=tile, IEEE=q.dtype == torch.float32,
        SOFTCAP=float(softcap or 0.0), FP8=fp8, F16=fp8 and q.dtype != torch.float32, num_warps=num_warps,
        num_stages=num_stages)
    return out
