"""Paged attention over the block-structured KV cache: the step's metadata, and the attention
arithmetic every device can run (app/engine/models/kernels.py picks what runs where).

Tokens arrive packed: first the decode tokens (one per sequence), then each prefill chunk. The
portable paths here run decodes as one batched SDPA over gathered blocks with a length mask, and
prefill chunks one SDPA each, causally within the chunk and fully over the cached prefix before it.

A sliding window (Mistral, Gemma 2's alternate layers) lets each query see only the last `window`
keys, itself included: transformers' `kv_idx > q_idx - window`. Every block of a sequence stays in
its cache (blocks that fell out of the window are not freed), the paths just skip or mask them.
Softcapped logits (Gemma 2: tanh(s / cap) * cap before the softmax) are beyond SDPA and torch's
flash attention: such attention is computed op by op, as transformers' eager attention does.

An FP8 cache (kv_cache_config.dtype fp8) holds x / scale in E4M3, with one key and one value scale
per layer (`kv_scales`, float32 tensors on the device, so CUDA graphs read them without the host).
The write hands the step's keys and values back as the cache holds them (rounded through FP8), so a
prefill chunk attends to exactly what decode steps, later chunks and prefix-cache hits will read.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.engine.transfer import to_device

# E4M3, the FP8 linears' format too: defined here, below kernels.py and layers.py in the imports.
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


@dataclass
class PackedPrefills:
    """Every prefill chunk of a step: queries are the step's rows after the decodes, keys each
    chunk's whole context (cached prefix + the chunk), packed in the same order. Flash attention's
    varlen call reads them as they are; the portable path walks `sizes`."""

    cu_q: torch.Tensor  # [chunks + 1] int32 offsets of each chunk's queries
    cu_k: torch.Tensor  # [chunks + 1] int32 offsets of each chunk's keys
    max_q: int
    max_k: int
    kv_slots: torch.Tensor | None  # cache slots of every chunk's keys; None: no prefix, the step's own keys
    sizes: list[tuple[int, int]]  # (num_tokens, context_len) per chunk, on the host

    @classmethod
    def build(cls, prefills: list[tuple[int, int, int, list[int]]], block_size: int,
              device: torch.device) -> PackedPrefills:
        """prefills: (start, num_tokens, context_len, block table) per chunk, in row order."""
        news, contexts = [p[1] for p in prefills], [p[2] for p in prefills]
        kv_slots = None
        if news != contexts:
            offsets = torch.arange(block_size)
            kv_slots = torch.cat([(torch.tensor(table)[:, None] * block_size + offsets).flatten()[:context]
                                  for _, _, context, table in prefills])
            kv_slots = to_device(kv_slots, device)

        def cumulative(sizes):
            starts = torch.tensor([0] + sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            return to_device(starts, device)
        return cls(cumulative(news), cumulative(contexts), max(news), max(contexts), kv_slots,
                   list(zip(news, contexts)))

    def keys(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Every chunk's context keys and values, packed, in k's dtype: the step's own where no chunk has
        a prefix (already as the cache holds them), else gathered from the cache."""
        if self.kv_slots is None:
            return k, v
        keys, values = (_select(cache.view(-1, k.shape[1], k.shape[2]), self.kv_slots) for cache in (k_cache, v_cache))
        if k_cache.dtype == FP8:
            keys, values = dequantize(keys, kv_scales[0], k.dtype), dequantize(values, kv_scales[1], v.dtype)
        return keys, values


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot written by each token
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [num_decodes] int32
    prefills: PackedPrefills | None


@functools.cache
def flash_varlen():
    """torch's varlen flash attention as f(q, k, v, cu_q, cu_k, max_q, max_k, scale, window), causal, or
    None where this torch has none. Its causal mask is aligned at each sequence's end (flash attention's
    convention), so a chunk's queries see its whole cached prefix. The keyword that asks for causal
    masking moved between torch releases: `is_causal`, later `window_size=(-1, 0)`. Only the latter
    takes a sliding window, `(window - 1, 0)`: that many keys left of the query, and the query's own
    (f.windowed says which; without it, windowed chunks take the portable path)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "scale" not in params:
        return None
    windowed = "window_size" in params
    options = {"enable_gqa": True} if "enable_gqa" in params else {}  # where torch asks, GQA is opt-in

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None):
        mask = {"window_size": (-1 if window is None else window - 1, 0)} if windowed else {"is_causal": True}
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, **mask, **options)
    attend.windowed = windowed
    return attend


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in E4M3, computed in float32; beyond +-448 saturates (as Triton's conversion does)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 cache's values times their scale, in float32, rounded once to `dtype`."""
    return (x.float() * scale).to(dtype)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's keys and values into their cache slots; returns them as the cache holds them."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if k_cache.dtype != FP8:
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)
        return k, v

    def write(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x8 = quantize(x, scale)
        # As bytes: index_copy_ has no FP8 kernel (on CPU at least).
        cache.view(-1, num_kv_heads, head_dim).view(torch.uint8).index_copy_(0, slots, x8.view(torch.uint8))
        return dequantize(x8, scale, x.dtype)
    return write(k, k_cache, kv_scales[0]), write(v, v_cache, kv_scales[1])


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, window: int | None, softcap: float | None,
                     kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q: [num_decodes, H, D], one query per sequence at the end of its context: one batched
    attention over each sequence's gathered blocks, masked to its length (and window)."""
    keys = _gather(k_cache, meta.decode_block_tables)  # [B, KVH, L, D]
    values = _gather(v_cache, meta.decode_block_tables)
    if k_cache.dtype == FP8:  # gathered in FP8, the fewest bytes, then dequantized
        keys, values = dequantize(keys, kv_scales[0], q.dtype), dequantize(values, kv_scales[1], q.dtype)
    lens = meta.decode_context_lens[:, None].long()
    positions = torch.arange(keys.shape[2], device=q.device)[None, :]
    mask = positions < lens
    if window is not None:  # each sequence's last `window` keys, its newest one included
        mask &= positions >= lens - window
    return _attend(q.unsqueeze(2), keys, values, mask[:, None, None, :], scale, softcap).squeeze(2)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, prefills: PackedPrefills, scale: float, window: int | None,
                      softcap: float | None, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> torch.Tensor:
    """q, k, v: the prefill rows of the step (k, v already in the caches). Chunk by chunk."""
    k, v = prefills.keys(k, v, k_cache, v_cache, kv_scales)
    out = torch.empty_like(q)
    row = key = 0
    for num_tokens, context_len in prefills.sizes:
        out[row:row + num_tokens] = _chunk_attention(q[row:row + num_tokens], k[key:key + context_len],
                                                     v[key:key + context_len], scale, window, softcap)
        row, key = row + num_tokens, key + context_len
    return out


def _chunk_attention(q, k, v, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """One prefill chunk: q [n, H, D] are the last n positions of the context whose keys and values
    are k, v [context_len, KVH, D]. Returns [n, H, D]."""
    n, context_len = q.shape[0], k.shape[0]
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if n == context_len and window is None and softcap is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        o = _attend(q, k, v, _causal_mask(n, context_len, q.device, window), scale, softcap)
    return o[0].transpose(0, 1)


def _attend(q, k, v, mask: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """q [B, H, n, D]; k, v [B, KVH, L, D]; mask [B or 1, 1, n, L], True where a query sees a key."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    # Op by op as transformers' eager attention, the path Gemma 2 runs there.
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1, dtype=torch.float32).to(q.dtype)
    return probs @ v


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, KVH, nb * bs, D] keys or values of the listed blocks (index_select: faster than indexing)."""
    b, nb = block_tables.shape
    blocks = _select(cache, block_tables.flatten())  # [B * nb, bs, KVH, D]
    return blocks.view(b, nb * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def _select(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache.index_select(0, index); an FP8 cache's as bytes, which every device can index."""
    if cache.dtype != FP8:
        return cache.index_select(0, index)
    return cache.view(torch.uint8).index_select(0, index).view(FP8)


def _causal_mask(num_queries: int, context_len: int, device, window: int | None) -> torch.Tensor:
    """Query i sits at position context_len - num_queries + i and sees keys up to it, or with a
    window only the last `window` of them."""
    q_pos = torch.arange(context_len - num_queries, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    return mask if window is None else mask & (k_pos > q_pos - window)
