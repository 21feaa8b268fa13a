"""LoRA adapters in the engine: a host cache and a bounded device cache, and the per-step batch
that lets one forward pass serve tokens of many adapters at once (reading them: lora_loader.py).

Each adapted linear adds, for every token, (x @ A.T) * scaling @ B.T of that token's own adapter,
two operations per module however many adapters share the batch: no per-adapter forward pass and
no weight merging; base-model tokens and any mix of adapters share one batch. On CUDA adapters sit
in fixed device slots that two Triton kernels read (LoRASlots); elsewhere the step's adapters are
stacked, with a per-token selector that zeroes the other adapters' columns (LoRAStack).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from app.engine.errors import InvalidRequestError
from app.engine.lora_loader import LoRAAdapter, load_adapter
from app.engine.transfer import list_to_device


@dataclass
class LoRAStack:
    """The step's adapters stacked per module: A as [S * r, in] and B as [S * r, out] per shard,
    ranks zero-padded to the largest, so every adapter of a step costs two matmuls in total."""

    names: tuple[str, ...]
    rank: int
    scalings: list[float]
    modules: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]]

    @classmethod
    def build(cls, adapters: list[LoRAAdapter]) -> LoRAStack:
        rank = max(a.rank for a in adapters)
        keys = {key for a in adapters for key in a.weights}
        modules = {}
        for key in keys:
            shards = {}
            for i, adapter in enumerate(adapters):
                for shard, a, b in adapter.weights.get(key, []):
                    if shard not in shards:
                        shards[shard] = (a.new_zeros(len(adapters) * rank, a.shape[1]),
                                         b.new_zeros(len(adapters) * rank, b.shape[0]))
                    stacked_a, stacked_b = shards[shard]
                    stacked_a[i * rank:i * rank + adapter.rank] = a
                    stacked_b[i * rank:i * rank + adapter.rank] = b.T
            modules[key] = [(shard, a, b) for shard, (a, b) in sorted(shards.items())]
        return cls(tuple(a.name for a in adapters), rank, [a.scaling for a in adapters], modules)


@dataclass
class LoRABatch:
    """One step's LoRA work: the stacked adapters, and for each token a row selecting (and
    scaling) its own adapter's columns; base-model tokens get a row of zeros."""

    stack: LoRAStack
    selector: torch.Tensor  # [T, S * r]

    def apply(self, x: torch.Tensor, y: torch.Tensor, key: tuple[int, str], offsets: list[int]) -> torch.Tensor:
        for shard, a, b in self.stack.modules.get(key, ()):
            start = offsets[shard]
            y[:, start:start + b.shape[1]] += ((x @ a.T) * self.selector) @ b
        return y

    def runs_beside(self, key: tuple[int, str]) -> bool:
        return False


class LoRASlots:
    """CUDA: adapters in fixed device slots, one weight pair per adapted module holding every slot.

    A [slots + 1, shards * R, in] (a merged linear's shards, q, k, v, stacked along the rank) and B
    [slots + 1, out, R], R the largest rank; slot 0 is base-model rows, never computed. A module
    costs two kernels (triton_lora.py) whatever adapters share the step, and only the slots the step
    uses are read. The buffers never move: decode steps with adapters
    replay from CUDA graphs, and loading an adapter is a copy into its slot, ordered on the stream
    after the steps already queued."""

    def __init__(self, model, num_slots: int, max_rank: int, projections: set[str], dtype: torch.dtype):
        self.rank = max_rank
        self.num_slots = num_slots
        self.weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, list[int]]] = {}
        for module in model.modules():
            key = getattr(module, "lora_key", None)
            if key is None or key[1] not in projections:
                continue
            width = len(module.out_sizes) * self.rank
            device = module.weight.device
            a = torch.zeros(num_slots + 1, width, module.weight.shape[1], dtype=dtype, device=device)
            b = torch.zeros(num_slots + 1, sum(module.out_sizes), self.rank, dtype=dtype, device=device)
            self.weights[key] = (a, b, module.offsets)
        # Where graphs run a module's adapters beside its base matmul (SlotBatch.beside).
        self.side_stream = torch.cuda.Stream(next(model.parameters()).device)
        self._compile()

    def _compile(self) -> None:
        """Run the kernels once per module shape and row-block size, so that Triton compiles them at
        start-up rather than in the first steps that carry an adapter."""
        shapes = {(a.shape, tuple(offsets)): (a, b, offsets) for a, b, offsets in self.weights.values()}
        for a, b, offsets in shapes.values():
            for rows in (1, 257):  # the decode and the prefill block sizes
                x = torch.zeros(rows, a.shape[2], dtype=a.dtype, device=a.device)
                self.batch([0] * rows, a.device).apply_weights(
                    x, torch.zeros(rows, b.shape[1], dtype=a.dtype, device=a.device), a, b, offsets)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy a folded adapter (this rank's; pinned on CUDA) into slot 1..num_slots; what it does
        not adapt stays zero."""
        for key, (a, b, offsets) in self.weights.items():
            a[slot].zero_()
            b[slot].zero_()
            for shard, lora_a, lora_b in adapter.weights.get(key, ()):
                rank = lora_a.shape[0]
                a[slot, shard * self.rank:shard * self.rank + rank].copy_(lora_a, non_blocking=True)
                b[slot, offsets[shard]:offsets[shard] + lora_b.shape[0], :rank].copy_(lora_b, non_blocking=True)

    def batch(self, row_slots: list[int], device: torch.device, num_items: int | None = None) -> SlotBatch:
        """The step's rows grouped by slot and cut into work items (on the host, where the slots are
        known); `num_items` pads the items to a graph's fixed count."""
        block_m = rows_per_block(len(row_slots))
        order = sorted(range(len(row_slots)), key=row_slots.__getitem__)
        counts = [0] * (self.num_slots + 1)
        for slot in row_slots:
            counts[slot] += 1
        items, start = [], counts[0]  # slot 0's rows come first and take no work
        for slot in range(1, self.num_slots + 1):
            end = start + counts[slot]
            items += [(slot, first, end) for first in range(start, end, block_m)]
            start = end
        items += [(0, 0, 0)] * ((num_items or len(items) or 1) - len(items))
        return SlotBatch(self, list_to_device(order, device), list_to_device(items, device, torch.int32), block_m)


# Steps of up to this many rows, in CUDA graphs, run each module's adapters beside its base matmul
# (SlotBatch.beside). Measured on an H200 (docs/PERFORMANCE.md): batch 1 with an adapter went from
# 0.82 to 0.97 of the base model; at 256 rows the side kernels slowed the matmuls they share the
# SMs with, 0.84 -> 0.72 with 8 adapters.
BESIDE_MAX_ROWS = 32


def rows_per_block(num_rows: int) -> int:
    """Rows one LoRA kernel program takes: few in decode batches, more in prefill."""
    return 16 if num_rows <= 256 else 64


def max_work_items(num_rows: int, num_slots: int) -> int:
    """The most work items a step of num_rows can have: what a graph's grid is sized for."""
    return -(-num_rows // rows_per_block(num_rows)) + min(num_slots, num_rows)


@dataclass
class SlotBatch:
    """One step's LoRA work over slots, on the device: `order` lists the step's rows grouped by slot,
    `items` the (slot, first position, group end) blocks of at most `block_m` rows the kernels take.
    Graphs capture it over static buffers (cuda_graphs.GraphLoRAInputs)."""

    slots: LoRASlots
    order: torch.Tensor  # [T] long
    items: torch.Tensor  # [W, 3] int32
    block_m: int
    beside_matmuls: bool = False  # a small step captured in a CUDA graph: see beside()

    def apply(self, x: torch.Tensor, y: torch.Tensor, key: tuple[int, str], offsets: list[int]) -> torch.Tensor:
        """LoRABatch.apply's signature; the slots hold each module's offsets themselves."""
        weights = self.slots.weights.get(key)
        return y if weights is None else self.apply_weights(x, y, *weights)

    def runs_beside(self, key: tuple[int, str]) -> bool:
        return self.beside_matmuls and key in self.slots.weights

    @contextmanager
    def beside(self, x: torch.Tensor, key: tuple[int, str], width: int) -> Iterator[torch.Tensor]:
        """Yields module `key`'s adapter delta for x, float32 [T, width], computed on a side stream
        while the block runs the base matmul on the current one, which waits for it on exit. In a
        graph the two become parallel branches: at batch 1 the adapter then costs about a quarter
        of its serial time (docs/PERFORMANCE.md). The delta is allocated on the current stream, so
        its memory is not reused before the join."""
        a, b, offsets = self.slots.weights[key]
        main, side = torch.cuda.current_stream(x.device), self.slots.side_stream
        delta = torch.empty(x.shape[0], width, dtype=torch.float32, device=x.device)
        side.wait_stream(main)
        try:  # joined whatever fails: a capture with an unjoined stream cannot even be ended
            with torch.cuda.stream(side):
                delta.zero_()  # rows without an adapter get no work item
                self.apply_weights(x, delta, a, b, offsets)
            yield delta
        finally:
            main.wait_stream(side)

    def apply_weights(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      offsets: list[int]) -> torch.Tensor:
        from app.engine.models.triton_lora import add_lora
        return add_lora(x, y, a, b, offsets, self.order, self.items, self.block_m)


class LoRACache:
    """Adapters by name: every registered one on the host, at most `device_slots` on the device
    (least recently used evicted; an adapter the current step needs is never evicted). On CUDA they
    live in LoRASlots, which decode graphs capture; elsewhere each step stacks the adapters it uses
    (LoRAStack)."""

    def __init__(self, device_slots: int, host_slots: int, max_rank: int, device: torch.device, dtype: torch.dtype,
                 shapes: dict[str, tuple[int, int]], num_layers: int, tp_size: int = 1, tp_rank: int = 0,
                 slots: LoRASlots | None = None):
        self.device_slots, self.host_slots, self.max_rank = device_slots, host_slots, max_rank
        self.tp_size, self.tp_rank = tp_size, tp_rank
        # What an adapter must fit: HF module -> full (unsharded) (in, out), and every layer of the
        # model (adapters name global layers, also on a pipeline stage that holds a few).
        self.shapes, self.num_layers = shapes, num_layers
        self.device, self.dtype = device, dtype
        self.slots = slots
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        # name -> its device copy (stacking) or its slot number (slots)
        self.on_device: OrderedDict[str, LoRAAdapter | int] = OrderedDict()
        self.loads = self.evictions = self.hits = self.misses = 0
        self._stack: LoRAStack | None = None  # rebuilt only when the step's adapter set changes
        self._stacked: tuple[LoRAAdapter, ...] = ()

    def prepare(self, name: str, path: Path) -> LoRAAdapter:
        """Read and check an adapter, keep this rank's shard, and fold and pin it where it goes to
        slots: the slow part of registering one (a rank-16 adapter of the 8B shape: about 200 ms). It
        reads only the cache's fixed settings, so an engine loop can have it done on another thread
        while steps run, and `add` the result."""
        if not self.device_slots:
            raise InvalidRequestError("lora", "this engine serves no adapters (max_loras is 0; a service config "
                                              "enables them with lora_roots or lora_adapters)")
        adapter = load_adapter(name, Path(path), self.max_rank, self.shapes, self.num_layers)
        adapter = adapter.shard(self.tp_size, self.tp_rank)
        return adapter.folded(self.dtype, pin=True) if self.slots is not None else adapter

    def add(self, name: str, adapter: LoRAAdapter, in_use: set[str] = frozenset()) -> None:
        """Register (or replace) a prepared adapter: it has passed every check, a refused one never
        gets here."""
        self.host[name] = adapter
        self.host.move_to_end(name)
        self.on_device.pop(name, None)  # a re-registered name takes the new weights
        for victim in [n for n in self.host if n not in in_use and n != name][:max(0, len(self.host) - self.host_slots)]:
            del self.host[victim]
            self.on_device.pop(victim, None)

    def __contains__(self, name: str) -> bool:
        return name in self.host

    def batch(self, rows_by_adapter: dict[str, list[int]], num_tokens: int,
              num_items: int | None = None) -> LoRABatch | SlotBatch | None:
        """The step's LoRA work, its adapters made resident; `num_items`: a graph's fixed count of
        slot work items."""
        if not rows_by_adapter:
            return None
        names = tuple(sorted(rows_by_adapter))
        for name in names:  # the host cache evicts the least recently used (every rank runs this step alike)
            self.host.move_to_end(name)
        resident = [self._resident(name, set(names)) for name in names]
        if self.slots is not None:
            row_slots = [0] * num_tokens  # 0: no adapter
            for name, rows in rows_by_adapter.items():
                for row in rows:
                    row_slots[row] = self.on_device[name]
            return self.slots.batch(row_slots, self.device, num_items)
        # A reloaded adapter is a new object: restack. Holding the old ones keeps `is` meaningful.
        if len(resident) != len(self._stacked) or any(a is not b for a, b in zip(resident, self._stacked)):
            self._stack, self._stacked = LoRAStack.build(resident), tuple(resident)
        stack = self._stack
        selector = torch.zeros(num_tokens, len(names) * stack.rank, device=self.device, dtype=self.dtype)
        for i, name in enumerate(names):
            rows = torch.tensor(rows_by_adapter[name], device=self.device)
            selector[rows, i * stack.rank:(i + 1) * stack.rank] = stack.scalings[i]
        return LoRABatch(stack, selector)

    def _resident(self, name: str, needed: set[str]) -> LoRAAdapter | int:
        if name in self.on_device:
            self.hits += 1
            self.on_device.move_to_end(name)
            return self.on_device[name]
        self.misses += 1
        for victim in list(self.on_device):
            if len(self.on_device) < self.device_slots:
                break
            if victim not in needed:
                del self.on_device[victim]
                self.evictions += 1
        if self.slots is None:
            self.on_device[name] = self.host[name].to(self.device, self.dtype)
        else:
            slot = min(set(range(1, self.device_slots + 1)) - set(self.on_device.values()))
            self.slots.load(slot, self.host[name])
            self.on_device[name] = slot
        self.loads += 1
        return self.on_device[name]
