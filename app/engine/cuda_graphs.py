"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode-only step (every sequence adds one token, no LoRA, no beam block copies) is padded to
the next bucket and replayed: one launch instead of hundreds of kernel launches from Python,
which is what bounds small-batch decode. Inputs live in static buffers the graphs were captured
on; padded rows write to a scratch KV block that no sequence owns and read one token of it.
"""
from __future__ import annotations

import torch

from app.engine.models.attention import AttentionMetadata


def bucket_sizes(max_batch_size: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch_size + 1, 16))
    return sorted({s for s in sizes if s <= max_batch_size} | {max_batch_size})


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], max_batch_size: int, max_blocks_per_seq: int,
                 scratch_block: int, block_size: int, device: torch.device):
        self.sizes = bucket_sizes(max_batch_size)
        n = self.sizes[-1]
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * block_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self.lens = torch.ones(n, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, device=device)  # which rows give logits: all of them
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        for size in reversed(self.sizes):  # largest first, so the smaller ones fit in its memory pool
            meta = AttentionMetadata(self.slots[:size], size, self.tables[:size], None, [], self.lens[:size])
            # Every tensor a graph reads must outlive it: views of the buffers above, never temporaries.
            args = (self.input_ids[:size], self.positions[:size], kv_caches, meta, self.rows[:size])
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                model(*args)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = model(*args)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(device)

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only step of B <= max_batch_size sequences."""
        b = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(meta.slot_mapping)
        width = meta.decode_block_tables.shape[1]
        self.tables[:b, :width].copy_(meta.decode_block_tables)
        self.lens[:b].copy_(meta.decode_context_lens)
        if size > b:  # rows of an earlier, larger step must not write into blocks that are now someone's
            self.slots[b:size].fill_(self.scratch_slot)
            self.tables[b:size, 0].fill_(self.scratch_block)
            self.lens[b:size].fill_(1)
        self.graphs[size].replay()
        return self.logits[size][:b]
