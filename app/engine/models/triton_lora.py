"""Many LoRA adapters in one batch on CUDA: segmented shrink and expand kernels (Punica's SGMV idea).

The step's rows are listed grouped by adapter slot (`order`), and cut into work items of at most
`block_m` rows of one slot: (slot, first position, end of the slot's group); rows without an
adapter get none. For each adapted module:
- shrink: h = x[rows] @ A[slot].T, one program per (item, slice of the input features), partial
  sums per slice, so a small batch still spreads over the SMs;
- expand: y[rows] += sum(h slices) @ B[slot].T, one program per (item, block of output features),
  each block within one output shard (q, k, v) and reading that shard's ranks only; added in
  place: each output element has one writer, no atomics.
Grids depend only on the number of items, which decode graphs fix per batch size (padding items
are empty and exit at once), so both kernels replay from the graphs.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit
def _item_rows(items_ptr, order_ptr, item, BLOCK_M: tl.constexpr):
    """This program's work item: its slot, first position and end (no rows where first >= end), and
    its positions (in the grouped order), their validity and row ids."""
    slot = tl.load(items_ptr + item * 3)
    first = tl.load(items_ptr + item * 3 + 1)
    end = tl.load(items_ptr + item * 3 + 2)
    positions = first + tl.arange(0, BLOCK_M)
    valid = positions < end
    rows = tl.load(order_ptr + positions, mask=valid, other=0)
    return slot, first, end, positions, valid, rows


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, order_ptr, items_ptr, h_ptr, K, R, k_chunk, stride_x, stride_a_slot, stride_a_rank,
                   stride_h_split, stride_h_pos, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    split = tl.program_id(1)
    slot, first, end, positions, valid, rows = _item_rows(items_ptr, order_ptr, tl.program_id(0), BLOCK_M)
    if first >= end:
        return
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_start = split * k_chunk
    for k in range(k_start, tl.minimum(k_start + k_chunk, K), BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=valid[:, None] & (cols[None, :] < K),
                    other=0.0)
        a = tl.load(a_ptr + slot * stride_a_slot + ranks[:, None] * stride_a_rank + cols[None, :],
                    mask=(ranks[:, None] < R) & (cols[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(a), input_precision=PRECISION)
    tl.store(h_ptr + split * stride_h_split + positions[:, None] * stride_h_pos + ranks[None, :], acc,
             mask=valid[:, None] & (ranks[None, :] < R))


# `splits` changes with the step's row count and is not specialized on (Triton compiles a variant per
# integer argument that is 1 or a multiple of 16): a new variant mid-serving costs a step a compile.
@triton.jit(do_not_specialize=["splits"])
def _expand_kernel(h_ptr, b_ptr, order_ptr, items_ptr, y_ptr, N, R, second, third, splits, stride_h_split,
                   stride_h_pos, stride_b_slot, stride_b_out, stride_y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    n_block = tl.program_id(1)
    slot, first, end, positions, valid, rows = _item_rows(items_ptr, order_ptr, tl.program_id(0), BLOCK_M)
    if first >= end:
        return
    # Output blocks never straddle shards (q, k, v): the block's shard picks its R columns of h.
    start = n_block * BLOCK_N
    shard = (start >= second).to(tl.int32) + (start >= third).to(tl.int32)
    ranks = tl.arange(0, BLOCK_R)
    h_mask = valid[:, None] & (ranks[None, :] < R)
    h_ptrs = h_ptr + positions[:, None] * stride_h_pos + shard * R + ranks[None, :]
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in range(splits):
        h += tl.load(h_ptrs + split * stride_h_split, mask=h_mask, other=0.0)
    outs = start + tl.arange(0, BLOCK_N)
    b = tl.load(b_ptr + slot * stride_b_slot + outs[:, None] * stride_b_out + ranks[None, :],
                mask=(outs[:, None] < N) & (ranks[None, :] < R), other=0.0)
    delta = tl.dot(h.to(b.dtype), tl.trans(b), input_precision=PRECISION)
    y_ptrs = y_ptr + rows[:, None] * stride_y + outs[None, :]
    y_mask = valid[:, None] & (outs[None, :] < N)
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=y_mask)


class Launch(NamedTuple):
    """The kernels' launch settings. Shrink: `block_k` input features per loop, input features split
    over up to `max_splits` programs per item, until the grid has `programs`. Expand: `block_n` output
    features per program (0: by rank). The defaults are for decode steps (16-row items): swept at 256
    rows on an H200 (`python -m tools.bench.kernels --only lora_launch`), they cut the 8B shape's
    adapter kernels from 118 to 92 us a layer with 64 adapters and cost 8 adapters under 1 us."""
    block_k: int = 128
    programs: int = 512
    max_splits: int = 16
    shrink_warps: int = 4
    block_n: int = 0
    expand_warps: int = 4


DECODE_LAUNCH = Launch()
# Prefill steps (64-row items) keep the settings the kernels had before the sweep, which did not time them.
PREFILL_LAUNCH = Launch(block_k=64, programs=256)


def shrink_block_k(block_width: int, launch: Launch) -> int:
    """The shrink's K block for A tiles of `block_width` ranks: the launch's, where the tile stays
    within 64 ranks x 128 features (wider outgrows shared memory in float32); else at most 64."""
    return launch.block_k if block_width * launch.block_k <= 64 * 128 else min(launch.block_k, 64)


def add_lora(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: list[int],
             order: torch.Tensor, items: torch.Tensor, block_m: int, launch: Launch | None = None) -> torch.Tensor:
    """y [T, N] += x [T, K] @ A[slot].T @ B[slot].T for each row's slot and each output shard, in
    place. a: [slots + 1, shards * R, K], each shard's A stacked along the rank; b: [slots + 1, N, R],
    shard i's rows from offsets[i] (both contiguous); order: [T] rows grouped by slot; items: [W, 3]
    int32 work items of at most block_m rows (lora.py builds both)."""
    launch = launch or (DECODE_LAUNCH if block_m <= 16 else PREFILL_LAUNCH)
    x = x.contiguous()
    t, k = x.shape
    width, (n, r), num_items = a.shape[1], b.shape[1:], items.shape[0]
    block_width = max(16, triton.next_power_of_2(width))
    block_k = shrink_block_k(block_width, launch)
    # Enough programs to fill the SMs when few rows share an adapter: split the input features.
    splits = max(1, min(launch.max_splits, launch.programs // num_items, triton.cdiv(k, block_k)))
    k_chunk = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_chunk)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 models stay exact
    # Rows padded to 16: h's split stride stays a multiple of 16, one compiled variant whatever T is.
    h = torch.empty(splits, triton.cdiv(t, 16) * 16, width, dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_items, splits)](
        x, a, order, items, h, k, width, k_chunk, x.stride(0), a.stride(0), a.stride(1), h.stride(0), h.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_width, BLOCK_K=block_k, PRECISION=precision,
        num_warps=launch.shrink_warps)
    block_r = max(16, triton.next_power_of_2(r))
    sizes = [end - start for start, end in zip(offsets, [*offsets[1:], n])]
    # fewer, wider programs where the rank is small
    block_n = launch.block_n or (256 if block_r <= 32 else 128 if block_r <= 64 else 64)
    while any(size % block_n for size in sizes):  # a block within one shard
        block_n //= 2
    second, third = ([*offsets[1:], n, n])[:2]
    _expand_kernel[(num_items, triton.cdiv(n, block_n))](
        h, b, order, items, y, n, r, second, third, splits, h.stride(0), h.stride(1), b.stride(0), b.stride(1),
        y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, PRECISION=precision,
        num_warps=launch.expand_warps)
    return y
