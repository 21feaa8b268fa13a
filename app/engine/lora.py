"""LoRA adapters in the engine: a host cache and a bounded device cache, and the per-step batch
that lets one forward pass serve tokens of many adapters at once (reading them: lora_loader.py).

Each adapted linear adds, for every token, (x @ A.T) * scaling @ B.T of that token's own adapter.
The step's adapters are stacked, so this is two matmuls per module however many adapters share
the batch, with a per-token selector that zeroes the other adapters' columns: no per-adapter
forward pass and no weight merging; base-model tokens and any mix of adapters share one batch.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from app.engine.lora_loader import LoRAAdapter, load_adapter


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


class LoRACache:
    """Adapters by name: every registered one on the host, at most `device_slots` on the device
    (least recently used evicted; an adapter the current step needs is never evicted)."""

    def __init__(self, device_slots: int, host_slots: int, max_rank: int, device: torch.device, dtype: torch.dtype,
                 shapes: dict[str, tuple[int, int]], num_layers: int, tp_size: int = 1, tp_rank: int = 0):
        self.device_slots, self.host_slots, self.max_rank = device_slots, host_slots, max_rank
        self.tp_size, self.tp_rank = tp_size, tp_rank
        # What an adapter must fit: HF module -> full (unsharded) (in, out), and every layer of the
        # model (adapters name global layers, also on a pipeline stage that holds a few).
        self.shapes, self.num_layers = shapes, num_layers
        self.device, self.dtype = device, dtype
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.on_device: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.loads = self.evictions = self.hits = self.misses = 0
        self._stack: LoRAStack | None = None  # rebuilt only when the step's adapter set changes
        self._stacked: tuple[LoRAAdapter, ...] = ()

    def add(self, name: str, path: Path, in_use: set[str] = frozenset()) -> None:
        """Register (or replace) an adapter once it has passed every check; a refused one changes nothing."""
        adapter = load_adapter(name, Path(path), self.max_rank, self.shapes, self.num_layers)
        adapter = adapter.shard(self.tp_size, self.tp_rank)
        self.host[name] = adapter
        self.host.move_to_end(name)
        self.on_device.pop(name, None)  # a re-registered name takes the new weights
        for victim in [n for n in self.host if n not in in_use and n != name][:max(0, len(self.host) - self.host_slots)]:
            del self.host[victim]
            self.on_device.pop(victim, None)

    def __contains__(self, name: str) -> bool:
        return name in self.host

    def batch(self, rows_by_adapter: dict[str, list[int]], num_tokens: int) -> LoRABatch | None:
        if not rows_by_adapter:
            return None
        names = tuple(sorted(rows_by_adapter))
        adapters = [self._resident(name, set(names)) for name in names]
        # A reloaded adapter is a new object: restack. Holding the old ones keeps `is` meaningful.
        if len(adapters) != len(self._stacked) or any(a is not b for a, b in zip(adapters, self._stacked)):
            self._stack, self._stacked = LoRAStack.build(adapters), tuple(adapters)
        stack = self._stack
        selector = torch.zeros(num_tokens, len(names) * stack.rank, device=self.device, dtype=self.dtype)
        for i, name in enumerate(names):
            rows = torch.tensor(rows_by_adapter[name], device=self.device)
            selector[rows, i * stack.rank:(i + 1) * stack.rank] = stack.scalings[i]
        return LoRABatch(stack, selector)

    def _resident(self, name: str, needed: set[str]) -> LoRAAdapter:
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
        self.on_device[name] = self.host[name].to(self.device, self.dtype)
        self.loads += 1
        return self.on_device[name]
