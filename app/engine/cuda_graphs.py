"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode-only step (every sequence adds one token, no beam block copies) is padded to the next
bucket and replayed: one launch instead of hundreds of kernel launches from Python, which is what
bounds small-batch decode. Inputs live in static buffers the graphs were captured on; padded rows
write to a scratch KV block that no sequence owns and read one token of it. Where adapters live in
LoRA slots, every bucket has a second graph with the slots' grouped GEMMs, whose row order and slot
ends are static buffers too (padded rows take slot 0, which is zero).
"""
from __future__ import annotations

import torch

from app.engine.lora import BESIDE_MAX_ROWS, LoRASlots, SlotBatch, max_work_items, rows_per_block
from app.engine.models.attention import AttentionMetadata


def bucket_sizes(max_batch_size: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch_size + 1, 16))
    return sorted({s for s in sizes if s <= max_batch_size} | {max_batch_size})


def lora_item_capacity(sizes: list[int], num_slots: int) -> int:
    """Rows the static LoRA work-item buffer needs: the most any bucket can use (not the largest
    bucket's: above 256 rows the blocks are larger, so a bucket there needs fewer items)."""
    return max(max_work_items(size, num_slots) for size in sizes)


class GraphLoRAInputs:
    """The LoRA inputs a graph reads, in static buffers: the step's rows grouped by slot and their work
    items, sized for every bucket (padded rows take slot 0, which is zero; padded items are empty)."""

    def __init__(self, slots: LoRASlots, sizes: list[int], device: torch.device):
        self.slots = slots
        self.order = torch.arange(max(sizes), device=device)
        self.items = torch.zeros(lora_item_capacity(sizes, slots.num_slots), 3, dtype=torch.int32,
                                 device=device)  # all empty until a step sets them

    def _items(self, size: int) -> int:
        return max_work_items(size, self.slots.num_slots)

    def batch(self, size: int) -> SlotBatch:
        """What a graph of `size` rows captures: views of the buffers, which outlive it."""
        return SlotBatch(self.slots, self.order[:size], self.items[:self._items(size)], rows_per_block(size),
                         beside_matmuls=size <= BESIDE_MAX_ROWS)

    def set(self, loras, lora_rows: dict[str, list[int]], size: int) -> None:
        """A step's rows by adapter (made resident in `loras`' slots), into the buffers."""
        assert loras.slots is self.slots, "the graphs were captured over another cache's slots"
        step = loras.batch(lora_rows, size, self._items(size))
        self.order[:size].copy_(step.order)
        self.items[:self._items(size)].copy_(step.items)


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], max_batch_size: int, max_blocks_per_seq: int,
                 scratch_block: int, block_size: int, device: torch.device, lora_slots: LoRASlots | None = None):
        self.sizes = bucket_sizes(max_batch_size)
        n = self.sizes[-1]
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * block_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self.lens = torch.ones(n, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, device=device)  # which rows give logits: all of them
        self.lora = GraphLoRAInputs(lora_slots, self.sizes, device) if lora_slots is not None else None
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}
        pool = None
        for size in reversed(self.sizes):  # largest first, so the smaller ones fit in its memory pool
            meta = AttentionMetadata(self.slots[:size], size, self.tables[:size], self.lens[:size], None)
            for adapted in (False, True) if self.with_lora else (False,):
                # Every tensor a graph reads must outlive it: views of the buffers above, never temporaries.
                lora = self.lora.batch(size) if adapted else None
                args = (self.input_ids[:size], self.positions[:size], kv_caches, meta, self.rows[:size], lora)
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    model(*args)  # warm-up: Triton compiles, cuBLAS picks its kernels
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[size, adapted] = model(*args)
                pool = graph.pool()
                self.graphs[size, adapted] = graph
        torch.cuda.synchronize(device)

    @property
    def with_lora(self) -> bool:
        return self.lora is not None

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, loras=None,
            lora_rows: dict[str, list[int]] | None = None) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only step of B <= max_batch_size sequences; `lora_rows`
        (adapter -> rows, resident in `loras`' slots) only where the graphs were captured with them."""
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
        if lora_rows:
            self.lora.set(loras, lora_rows, size)
        self.graphs[size, bool(lora_rows)].replay()
        return self.logits[size, bool(lora_rows)][:b]
