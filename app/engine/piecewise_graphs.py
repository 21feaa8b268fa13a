"""Steps that carry prefill chunks, replayed from CUDA graphs piece by piece, with attention run
eagerly between the pieces.

A decode graph (cuda_graphs.py) holds a whole step, attention included, because a decode row's
attention has a fixed shape. A step with prefill chunks does not: how its rows split into chunks,
and what each chunk sees of the cache, changes every step. Launched op by op, such a step costs
the host about as much as the GPU's work (hundreds of kernels from Python), and on arrival-heavy
traffic nearly every step carries a prompt. So the model's trunk (embedding, norms, projections,
rotary + cache write, MLPs) is captured once per token-count bucket, cut at every attention call:
one graph per cut, 33 for a 32-layer model. A step replays piece 0, runs layer 0's attention on its
real rows from the buffers piece 0 wrote, replays piece 1, which reads the attention output from a
static buffer, and so on; the final norm and lm_head then run on the rows that sample.

What eager code reads across a cut lives in static buffers sized for the largest bucket and shared
by every layer and bucket: each piece ends by copying the layer's q, k and v (attention's inputs;
12 KB a token a layer on the 8B shape) into them, and the last piece copies the trunk's output (the
head's input). Only one bucket replays at a time, and one layer's attention at a time, so one set
serves all, and a bucket's own blocks (the residual stream and rope tables that only its later
pieces read among them) are free for the next bucket's capture. Kept per bucket (views of each
layer's qkv projection), they pinned pool blocks in every bucket: on the 8B shape the graphs took
1.3 GiB of an H200's KV pool up to 512 tokens and 12.9 GiB up to 2,048, against 0.4 and 0.9 GiB
now (docs/PERFORMANCE.md).

Padded rows (the step's rows up to the bucket) take the scratch slot for their keys and values and
never reach attention, so their rows of the attention output hold whatever an earlier step left
there: finite values that only they read, since every op in the pieces works row by row. Where
adapters live in LoRA slots, every bucket has a second set of pieces with the slots' kernels, whose
row grouping is read from static buffers too (cuda_graphs.GraphLoRAInputs).
"""
from __future__ import annotations

from contextlib import contextmanager, suppress
from dataclasses import dataclass

import torch

from app.engine.cuda_graphs import GraphLoRAInputs
from app.engine.lora import LoRASlots
from app.engine.models.attention import AttentionMetadata


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts a graph is captured for: powers of two to 256, then every 128 (a step is padded
    to the next: a small step's GEMMs cost about the same padded, a large one's padding stays small)."""
    sizes = [16, 32, 64, 128, 256] + list(range(384, max_tokens + 1, 128))
    return sorted({s for s in sizes if s <= max_tokens} | {max_tokens})


@dataclass
class Piece:
    graph: torch.cuda.CUDAGraph
    attention: tuple | None  # the attention call that follows: (q, k, v, k_cache, v_cache, *rest); None: last


class PiecewiseGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], max_tokens: int, scratch_slot: int,
                 dtype: torch.dtype, device: torch.device, lora_slots: LoRASlots | None = None,
                 stream: torch.cuda.Stream | None = None):
        """`stream`: the one to capture on (default: a new one; cuBLAS keeps a workspace per stream)."""
        self.model, self.kernels = model, model.kernels
        self.sizes = token_buckets(max_tokens)
        n = self.sizes[-1]
        self.scratch_slot = scratch_slot
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), scratch_slot, dtype=torch.long, device=device)
        attn = model.layers[0].self_attn
        heads = {"q": attn.num_heads, "k": attn.num_kv_heads, "v": attn.num_kv_heads}
        # What eager code reads or writes between pieces: attention's inputs and output, and the head's input.
        self.attention_in = {name: torch.zeros(n, h, attn.head_dim, dtype=dtype, device=device)
                             for name, h in heads.items()}
        self.attention_out = torch.zeros(n, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
        hidden = model.config.hidden_size
        self.trunk_out = (torch.zeros(n, hidden, dtype=dtype, device=device),
                          torch.zeros(n, hidden, dtype=dtype, device=device))
        self.lora = GraphLoRAInputs(lora_slots, self.sizes, device) if lora_slots is not None else None
        self.pieces: dict[tuple[int, bool], list[Piece]] = {}  # (bucket, adapted)
        # Every piece of every bucket shares one pool, captured on one stream (the allocator reuses a
        # block only on the stream that freed it), largest bucket first: the smaller ones' temporaries fit
        # in what it freed.
        self._pool = torch.cuda.graph_pool_handle()
        stream = stream or torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                for adapted in (False, True) if self.lora is not None else (False,):
                    self._capture(size, adapted, kv_caches, stream)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def _capture(self, size: int, adapted: bool, kv_caches: list[torch.Tensor], stream: torch.cuda.Stream) -> None:
        """The pieces of one bucket, captured on `stream` (the current one)."""
        # Attention reads no slots here: only the trunk's cache writes do, from this static buffer.
        meta = AttentionMetadata(self.slots[:size], 0, None, None, None)
        lora = self.lora.batch(size) if adapted else None
        args = (self.input_ids[:size], self.positions[:size], kv_caches, meta, lora)
        out = self.attention_out[:size]
        with self._at_attention(lambda *_: out):
            self.model.trunk(*args)  # warm-up: Triton compiles for this size, cuBLAS picks its kernels
        stream.synchronize()
        pieces: list[Piece] = []
        graph = self._begin()

        def cut(q, k, v, k_cache, v_cache, _meta, *rest):
            nonlocal graph
            staged = self._stage(size, self.attention_in.values(), (q, k, v))
            graph.capture_end()
            pieces.append(Piece(graph, (*staged, k_cache, v_cache, *rest)))
            graph = self._begin()
            return out
        try:
            with self._at_attention(cut):
                self._stage(size, self.trunk_out, self.model.trunk(*args))
        except BaseException:  # a capture left open would swallow every later launch on this stream
            # (if ending it fails too, the pool may stay routed; the engine does not start either way)
            with suppress(Exception):
                graph.capture_end()
            raise
        graph.capture_end()
        pieces.append(Piece(graph, None))
        self.pieces[size, adapted] = pieces

    @staticmethod
    def _stage(size: int, buffers, tensors) -> list[torch.Tensor]:
        """The first `size` rows of each static buffer, filled from its tensor (recorded in the piece
        being captured): what the next piece or attention reads then outlives this bucket's pool blocks."""
        staged = [buffer[:size] for buffer in buffers]
        for buffer, tensor in zip(staged, tensors, strict=True):  # copy_ would cast or broadcast a mismatch silently
            if buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                raise RuntimeError(f"piecewise graphs: a cut's {tuple(tensor.shape)} {tensor.dtype} does not fit its "
                                   f"buffer's {tuple(buffer.shape)} {buffer.dtype}")
            buffer.copy_(tensor)
        return staged

    def _begin(self) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
        return graph

    @contextmanager
    def _at_attention(self, call):
        """The kernels' attention replaced by `call` while the trunk is captured (an instance
        attribute shadows the method; deleting it restores the method)."""
        self.kernels.attention = call
        try:
            yield
        finally:
            del self.kernels.attention

    @property
    def with_lora(self) -> bool:
        return self.lora is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logits_indices: torch.Tensor, loras=None, lora_rows: dict[str, list[int]] | None = None) -> torch.Tensor:
        """Logits of the `logits_indices` rows of a step of at most max_tokens rows; `lora_rows` (adapter
        -> rows, resident in `loras`' slots) only where the pieces were captured with them."""
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        if size > n:  # padded rows must not write into blocks that are now someone's
            self.slots[n:size].fill_(self.scratch_slot)
        if lora_rows:
            self.lora.set(loras, lora_rows, size)
        out = self.attention_out
        for piece in self.pieces[size, bool(lora_rows)]:
            piece.graph.replay()
            if piece.attention is not None:
                q, k, v, k_cache, v_cache, *rest = piece.attention
                self.kernels.attention(q[:n], k[:n], v[:n], k_cache, v_cache, meta, *rest, out[:n])
        return self.model.head(*self.trunk_out, logits_indices)
