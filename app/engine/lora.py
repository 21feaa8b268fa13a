"""LoRA adapters: loading (PEFT format), a host cache and a bounded device cache, and the
per-step batch that lets one forward pass serve tokens of many adapters at once.

Each adapted linear adds, for every token, (x @ A.T) * scaling @ B.T of that token's own adapter.
The step's adapters are stacked, so this is two matmuls per module however many adapters share
the batch, with a per-token selector that zeroes the other adapters' columns: no per-adapter
forward pass and no weight merging; base-model tokens and any mix of adapters share one batch.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from app.engine.errors import InvalidRequestError

# PEFT module name -> (our module within a decoder layer, shard of a merged linear)
TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
           "down_proj": ("mlp.down_proj", 0)}
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")  # the others are column-parallel


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    scaling: float
    # (layer index, module path) -> [(shard, A [r, in], B [out, r])]
    weights: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]]

    def shard(self, tp_size: int, tp_rank: int) -> LoRAAdapter:
        """This tensor-parallel rank's slice: B's output rows of a column linear, A's input columns
        of a row linear (whose partial deltas the layer's all-reduce then sums)."""
        if tp_size == 1:
            return self
        sliced = {key: [(s, a.chunk(tp_size, 1)[tp_rank] if key[1] in ROW_PARALLEL else a,
                         b if key[1] in ROW_PARALLEL else b.chunk(tp_size, 0)[tp_rank]) for s, a, b in shards]
                  for key, shards in self.weights.items()}
        return LoRAAdapter(self.name, self.rank, self.scaling, sliced)

    def to(self, device: torch.device, dtype: torch.dtype) -> LoRAAdapter:
        moved = {key: [(s, a.to(device, dtype), b.to(device, dtype)) for s, a, b in shards]
                 for key, shards in self.weights.items()}
        return LoRAAdapter(self.name, self.rank, self.scaling, moved)


def load_peft_adapter(name: str, path: Path, max_rank: int) -> LoRAAdapter:
    """Read adapter_config.json + adapter_model.safetensors; refuse what we cannot apply exactly."""
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise InvalidRequestError("lora_path", f"{path} must hold adapter_config.json and adapter_model.safetensors "
                                               "(PEFT) or model.lora_weights.npy and model.lora_config.npy "
                                               "(TensorRT-LLM)")
    config = json.loads(config_file.read_text())
    rank = int(config.get("r", 0))
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise InvalidRequestError("lora_path", "only plain LoRA adapters are supported (not DoRA or other PEFT types)")
    if not 1 <= rank <= max_rank:
        raise InvalidRequestError("lora_path", f"adapter rank {rank} must be in [1, max_lora_rank={max_rank}]")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    tensors: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}
    with safe_open(weights_file, framework="pt") as f:
        for key in f.keys():
            parts = key.split(".")
            if "layers" not in parts or parts[-2] not in ("lora_A", "lora_B"):
                raise InvalidRequestError("lora_path", f"unsupported adapter tensor {key!r}")
            layer, module = int(parts[parts.index("layers") + 1]), parts[-3]
            if module not in TARGETS:
                raise InvalidRequestError("lora_path", f"adapter targets {module!r}; supported: {', '.join(TARGETS)}")
            target, shard = TARGETS[module]
            tensors.setdefault((layer, target, shard), {})[parts[-2]] = f.get_tensor(key).float()
    weights: dict[tuple[int, str], list] = {}
    for (layer, target, shard), pair in sorted(tensors.items()):
        weights.setdefault((layer, target), []).append((shard, pair["lora_A"], pair["lora_B"]))
    return LoRAAdapter(name, rank, scaling, weights)


# TensorRT-LLM's LoRA module ids (LoraManager.LORA_MODULE_IDS) -> the HF module they adapt.
# Its converter maps up_proj to "mlp_gate" (7) and gate_proj to "mlp_h_to_4h" (5).
TRTLLM_MODULES = {1: "q_proj", 2: "k_proj", 3: "v_proj", 4: "o_proj", 5: "gate_proj", 6: "down_proj", 7: "up_proj"}


def load_trtllm_adapter(name: str, path: Path, max_rank: int, shapes: dict[str, tuple[int, int]]) -> LoRAAdapter:
    """The format the seeds' hf_lora_convert.py writes: model.lora_config.npy rows of
    [module_id, layer, rank] and model.lora_weights.npy rows of A [rank, in] then B * scale
    [out, rank], flattened and zero-padded. The scale is already in B."""
    import numpy as np

    config = np.load(path / "model.lora_config.npy").reshape(-1, 3)
    rows = np.load(path / "model.lora_weights.npy")
    rows = rows.reshape(config.shape[0], -1)
    weights: dict[tuple[int, str], list] = {}
    top_rank = 0
    for (module_id, layer, rank), row in zip(config.tolist(), rows):
        module = TRTLLM_MODULES.get(module_id)
        if module is None:
            raise InvalidRequestError("lora_config", f"LoRA module id {module_id} is not supported; "
                                                     f"supported: {sorted(TRTLLM_MODULES)}")
        if not 1 <= rank <= max_rank:
            raise InvalidRequestError("lora_config", f"adapter rank {rank} must be in [1, max_lora_rank={max_rank}]")
        fan_in, fan_out = shapes[module]
        flat = torch.from_numpy(np.ascontiguousarray(row)).float()
        a = flat[:rank * fan_in].reshape(rank, fan_in)
        b = flat[rank * fan_in:rank * (fan_in + fan_out)].reshape(fan_out, rank)
        target, shard = TARGETS[module]
        weights.setdefault((layer, target), []).append((shard, a, b))
        top_rank = max(top_rank, rank)
    for shards in weights.values():
        shards.sort(key=lambda s: s[0])
    return LoRAAdapter(name, top_rank, 1.0, weights)


def to_trtllm_arrays(adapter: LoRAAdapter):
    """The adapter in TensorRT-LLM's request format (what Triton's lora_weights / lora_config take):
    rows of [module_id, layer, rank] and rows of A then B * scaling, flattened and zero-padded, float16."""
    import numpy as np

    module_ids = {TARGETS[hf]: module_id for module_id, hf in TRTLLM_MODULES.items()}
    config, rows = [], []
    for (layer, target), shards in sorted(adapter.weights.items()):
        for shard, a, b in shards:
            config.append([module_ids[(target, shard)], layer, a.shape[0]])
            rows.append(torch.cat([a.flatten(), (b * adapter.scaling).flatten()]).numpy())
    weights = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.float16)
    for i, row in enumerate(rows):
        weights[i, :len(row)] = row
    return weights, np.asarray(config, dtype=np.int32)


def load_adapter(name: str, path: Path, max_rank: int, shapes: dict[str, tuple[int, int]]) -> LoRAAdapter:
    if (path / "model.lora_weights.npy").is_file() and (path / "model.lora_config.npy").is_file():
        return load_trtllm_adapter(name, path, max_rank, shapes)
    return load_peft_adapter(name, path, max_rank)


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
                 shapes: dict[str, tuple[int, int]], tp_size: int = 1, tp_rank: int = 0):
        self.device_slots, self.host_slots, self.max_rank = device_slots, host_slots, max_rank
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.shapes = shapes  # HF module -> (in, out), to read the TensorRT-LLM format
        self.device, self.dtype = device, dtype
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.on_device: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.loads = self.evictions = self.hits = self.misses = 0
        self._stack: LoRAStack | None = None  # rebuilt only when the step's adapter set changes
        self._stacked: tuple[LoRAAdapter, ...] = ()

    def add(self, name: str, path: Path, in_use: set[str] = frozenset()) -> None:
        adapter = load_adapter(name, Path(path), self.max_rank, self.shapes).shard(self.tp_size, self.tp_rank)
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
