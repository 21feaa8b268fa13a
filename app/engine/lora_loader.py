"""LoRA adapters read from disk, PEFT or TensorRT-LLM format, and checked whole against the model
(config, ranks, shapes, layers, target modules, finite values) so that a bad adapter is refused with
a message naming the problem and never reaches an engine step."""
from __future__ import annotations

import json
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from app.engine.errors import InvalidRequestError
from app.engine.models.llama import LlamaForCausalLM

# PEFT module name -> (our module within a decoder layer, shard of a merged linear): the model's table
TARGETS = LlamaForCausalLM.PROJECTIONS
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

    def folded(self, dtype: torch.dtype, pin: bool = False) -> LoRAAdapter:
        """On the host with the scaling folded into B (scaling 1), what LoRA slots hold; `pin`:
        page-locked, so that copies to the device do not wait for the work already queued there."""
        def host(t: torch.Tensor) -> torch.Tensor:
            t = t.to(dtype)
            return t.pin_memory() if pin else t
        moved = {key: [(s, host(a), host(b * self.scaling)) for s, a, b in shards] for key, shards in self.weights.items()}
        return LoRAAdapter(self.name, self.rank, 1.0, moved)


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # the safetensors dtypes a LoRA weight may have
# PEFT's tensor names: [prefix.]layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight
PEFT_KEY = re.compile(r"(?:.*\.)?layers\.(\d{1,9})\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
NOT_AN_ADAPTER = ("its directory must hold adapter_config.json and adapter_model.safetensors (PEFT) "
                  "or model.lora_weights.npy and model.lora_config.npy (TensorRT-LLM)")
# The adapter_config.json fields read here and the JSON types each may have (null counts as absent).
CONFIG_TYPES = {"peft_type": (str,), "r": (int,), "lora_alpha": (int, float), "use_rslora": (bool,),
                "target_modules": (list, str), "exclude_modules": (list, str)}
# PEFT features that change the arithmetic while the tensors still fit: refused, never ignored.
UNSUPPORTED = ("use_dora", "rank_pattern", "alpha_pattern", "layer_replication", "alora_invocation_tokens")
JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
              float: "a number", type(None): "null"}


@dataclass
class AdapterCheck:
    """Refusals while reading one adapter. Messages name the adapter and the problem but never a
    path: they go back to the client, and a path would tell it the server's directories."""

    name: str
    field: str  # the request field the error names

    def fail(self, problem: str) -> InvalidRequestError:
        return InvalidRequestError(self.field, f"adapter {self.name!r}: {problem}")

    @contextmanager
    def reading(self, file: str):
        """Turns a file that cannot be read or parsed into a refusal naming the file, not its path."""
        try:
            yield
        except InvalidRequestError:
            raise
        except (OSError, ValueError, EOFError, SafetensorError) as exc:
            raise self.fail(f"{file} is unreadable or corrupt ({type(exc).__name__})") from exc

    def finite(self, where: str, tensor: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(tensor).all():
            raise self.fail(f"{where} holds values that are not finite (inf or nan)")
        return tensor


def load_peft_adapter(name: str, path: Path, max_rank: int, shapes: dict[str, tuple[int, int]] | None = None,
                      num_layers: int | None = None) -> LoRAAdapter:
    """Read adapter_config.json + adapter_model.safetensors, checked whole against the base model
    (`shapes`: HF module -> full (in, out), and `num_layers`) so that a bad adapter is refused here
    and never reaches a step. Without the model (the Triton backend) only what the adapter says of
    itself is checked."""
    check = AdapterCheck(name, "lora_path")
    if not _holds(path, "adapter_config.json", "adapter_model.safetensors"):
        raise check.fail(NOT_AN_ADAPTER)
    config = _peft_config(check, path / "adapter_config.json", max_rank)
    rank = config["r"]
    pairs = _peft_tensors(check, path / "adapter_model.safetensors", rank, shapes, num_layers)
    _check_targets(check, config, pairs)
    weights: dict[tuple[int, str], list] = {}
    for (layer, module), pair in sorted(pairs.items(), key=lambda item: (item[0][0], *TARGETS[item[0][1]])):
        target, shard = TARGETS[module]
        weights.setdefault((layer, target), []).append((shard, pair["A"], pair["B"]))
    return LoRAAdapter(name, rank, _scaling(check, config, rank), weights)


def _holds(path: Path, *files: str) -> bool:
    try:
        return all((path / file).is_file() for file in files)
    except OSError:  # a directory we may not look into holds nothing we can read
        return False


def _peft_config(check: AdapterCheck, file: Path, max_rank: int) -> dict:
    """adapter_config.json as a dict whose fields have the right types, a rank in range, and no
    feature we cannot apply exactly."""
    with check.reading("adapter_config.json"):
        text = file.read_text()
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise check.fail("adapter_config.json is not valid JSON") from exc
    if not isinstance(config, dict):
        raise check.fail(f"adapter_config.json must hold a JSON object, not {JSON_TYPES[type(config)]}")
    for key, types in CONFIG_TYPES.items():
        value = config.get(key)
        if value is not None and type(value) not in types:
            raise check.fail(f"adapter_config.json's {key!r} must be {' or '.join(JSON_TYPES[t] for t in types)}, "
                             f"not {JSON_TYPES[type(value)]}")
    if config.get("peft_type", "LORA") != "LORA":
        raise check.fail(f"it is a {config['peft_type']!r} adapter; only LoRA is supported")
    used = [key for key in UNSUPPORTED if config.get(key)]
    if used:
        raise check.fail(f"it uses {', '.join(used)}; only plain LoRA is supported")
    targets = config.get("target_modules")
    if isinstance(targets, list) and not all(isinstance(t, str) for t in targets):
        raise check.fail("adapter_config.json's 'target_modules' must list module names")
    rank = config.get("r")
    if rank is None or not 1 <= rank <= max_rank:
        raise check.fail(f"its rank (adapter_config.json's 'r') must be in [1, max_lora_rank={max_rank}], "
                         f"not {json.dumps(rank)}")
    return config


def _scaling(check: AdapterCheck, config: dict, rank: int) -> float:
    alpha = config.get("lora_alpha", rank)
    if not abs(alpha) <= sys.float_info.max:  # exact for any integer (no overflow), false for nan
        raise check.fail("adapter_config.json's 'lora_alpha' must be a finite number")
    return float(alpha) / (rank ** 0.5 if config.get("use_rslora") else rank)


def _peft_tensors(check: AdapterCheck, file: Path, rank: int, shapes: dict[str, tuple[int, int]] | None,
                  num_layers: int | None, read: bool = True) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, module) -> {"A": [rank, in], "B": [out, rank]}, float32. Each tensor's name, dtype
    and shape are checked from the file's header before its data is read; with `read` False the
    data is not read (the pairs hold None)."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with check.reading("adapter_model.safetensors"), safe_open(file, framework="pt") as f:
        for key in f.keys():
            layer, module, which = _peft_key(check, key, num_layers)
            where = f"lora_{which} of layers.{layer} {module}"
            _check_reach(check, where, module, shapes)
            pair = pairs.setdefault((layer, module), {})
            if which in pair:
                raise check.fail(f"{where} appears twice")
            _check_header(check, where, f.get_slice(key), which, rank, shapes[module] if shapes else None)
            pair[which] = check.finite(where, f.get_tensor(key).float()) if read else None
    if not pairs:
        raise check.fail("adapter_model.safetensors holds no LoRA weights")
    for (layer, module), pair in pairs.items():
        if len(pair) == 1:
            present, missing = ("A", "B") if "A" in pair else ("B", "A")
            raise check.fail(f"layers.{layer} {module} has lora_{present} but no lora_{missing}")
    return pairs


def _peft_key(check: AdapterCheck, key: str, num_layers: int | None) -> tuple[int, str, str]:
    """(layer, module, "A" or "B") of a PEFT tensor name; refused unless it is one we apply."""
    match = PEFT_KEY.fullmatch(key)
    target = TARGETS.get(match[3]) if match else None
    if target is None or not target[0].startswith(match[2] + "."):
        raise check.fail(f"tensor {key[:200]!r} is not a LoRA weight of {', '.join(TARGETS)}")
    layer = int(match[1])
    if num_layers is not None and layer >= num_layers:
        raise check.fail(f"lora_{match[4]} of {match[3]} is for layer {layer} but the model has {num_layers} layers")
    return layer, match[3], match[4]


def _check_reach(check: AdapterCheck, where: str, module: str, shapes: dict[str, tuple[int, int]] | None) -> None:
    """A projection the model's adapters cannot reach (a mixture of experts has no dense MLP) is refused."""
    if shapes is not None and module not in shapes:
        raise check.fail(f"{where}: this model's adapters reach {', '.join(shapes)} only")


def _check_header(check: AdapterCheck, where: str, view, which: str, rank: int,
                  dims: tuple[int, int] | None) -> None:
    """A is [rank, in] and B [out, rank], floating point; `dims` is the module's (in, out), None
    where the model is not known."""
    fan_in, fan_out = dims or (None, None)
    need = [rank, fan_in] if which == "A" else [fan_out, rank]
    dtype, shape = view.get_dtype(), view.get_shape()
    if dtype not in FLOAT_DTYPES:
        raise check.fail(f"{where} is {dtype}; LoRA weights must be floating point ({', '.join(FLOAT_DTYPES)})")
    if len(shape) != 2 or any(n is not None and n != s for n, s in zip(need, shape)):
        wanted = ", ".join("any" if n is None else str(n) for n in need)
        raise check.fail(f"{where} is {list(shape)} but rank {rank} needs [{wanted}]")


def _check_targets(check: AdapterCheck, config: dict, pairs: dict[tuple[int, str], dict]) -> None:
    """The tensors against adapter_config.json's target_modules, where that is a list (matched as
    PEFT does: a module's full name or a suffix after a dot).
    - A tensor for a module the list does not name is refused: PEFT would not load it, so serving it
      would not serve the adapter its author tested.
    - A listed q_proj ... down_proj with no tensors at all is refused: PEFT saves both matrices of
      every module it adapts, so these weights are not the ones this config was trained with. Not
      checked when exclude_modules is set, which may have taken every such module out.
    - Other entries (dotted paths, other architectures' names) may match nothing, as in PEFT, and
      the string form (a regex, which is not run on client input here, or "all-linear") is not
      matched. Every tensor is checked against the model either way."""
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        return
    for layer, module in pairs:
        full_name = f"model.layers.{layer}.{TARGETS[module][0].split('.')[0]}.{module}"
        if not any(full_name == t or full_name.endswith("." + t) for t in targets):
            raise check.fail(f"it holds weights for layers.{layer} {module}, which adapter_config.json's "
                             "target_modules does not name")
    adapted = {module for _, module in pairs}
    missing = [t for t in targets if t in TARGETS and t not in adapted]
    if missing and not config.get("exclude_modules"):
        raise check.fail(f"adapter_config.json targets {', '.join(missing)} but adapter_model.safetensors "
                         "holds no weights for it")


# TensorRT-LLM's LoRA module ids (LoraManager.LORA_MODULE_IDS) -> the HF module they adapt.
# Its converter maps up_proj to "mlp_gate" (7) and gate_proj to "mlp_h_to_4h" (5).
TRTLLM_MODULES = {1: "q_proj", 2: "k_proj", 3: "v_proj", 4: "o_proj", 5: "gate_proj", 6: "down_proj", 7: "up_proj"}


def load_trtllm_adapter(name: str, path: Path, max_rank: int, shapes: dict[str, tuple[int, int]],
                        num_layers: int) -> LoRAAdapter:
    """The format the seeds' hf_lora_convert.py writes: model.lora_config.npy rows of
    [module_id, layer, rank] and model.lora_weights.npy rows of A [rank, in] then B * scale
    [out, rank], flattened and zero-padded. The scale is already in B. Checked whole, as the PEFT
    format is: every row's module, layer, rank and length, and finite values."""
    check = AdapterCheck(name, "lora_config")
    config, rows = _trtllm_arrays(check, path)
    weights: dict[tuple[int, str], list] = {}
    for i, ((module_id, layer, rank), row) in enumerate(zip(config.tolist(), rows)):
        module = _trtllm_module(check, i, module_id, layer, rank, max_rank, num_layers)
        where = f"row {i} (layers.{layer} {module})"
        _check_reach(check, where, module, shapes)
        fan_in, fan_out = shapes[module]
        need = rank * (fan_in + fan_out)
        if need > row.shape[0]:
            raise check.fail(f"{where} holds {row.shape[0]} values but rank {rank} needs {need}")
        flat = check.finite(where, torch.from_numpy(row[:need].copy()))
        target, shard = TARGETS[module]
        shards = weights.setdefault((layer, target), [])
        if any(s == shard for s, _, _ in shards):
            raise check.fail(f"{where} appears twice")
        shards.append((shard, flat[:rank * fan_in].reshape(rank, fan_in), flat[rank * fan_in:].reshape(fan_out, rank)))
    for shards in weights.values():
        shards.sort(key=lambda s: s[0])
    return LoRAAdapter(name, int(config[:, 2].max()), 1.0, weights)


def _trtllm_arrays(check: AdapterCheck, path: Path):
    """model.lora_config.npy as [n, 3] integers and model.lora_weights.npy as n float32 rows."""
    import numpy as np

    arrays = []
    for file in ("model.lora_config.npy", "model.lora_weights.npy"):
        with check.reading(file):
            array = np.load(path / file, allow_pickle=False)  # a pickle would run the sender's code
        if not isinstance(array, np.ndarray):
            raise check.fail(f"{file} must hold one array, not an archive")
        arrays.append(array)
    config, rows = arrays
    if config.dtype.kind not in "iu" or config.size == 0 or config.size % 3:
        raise check.fail("model.lora_config.npy must hold integer rows of [module_id, layer, rank]")
    config = config.reshape(-1, 3)
    if rows.dtype.kind != "f" or rows.size % len(config):
        raise check.fail("model.lora_weights.npy must hold one floating-point row per model.lora_config.npy row")
    return config, rows.reshape(len(config), -1).astype(np.float32)


def _trtllm_module(check: AdapterCheck, i: int, module_id: int, layer: int, rank: int, max_rank: int,
                   num_layers: int) -> str:
    """The HF module of a model.lora_config.npy row, whose layer and rank are in range."""
    module = TRTLLM_MODULES.get(module_id)
    if module is None:
        raise check.fail(f"row {i}: LoRA module id {module_id} is not supported; supported: {sorted(TRTLLM_MODULES)}")
    if not 0 <= layer < num_layers:
        raise check.fail(f"row {i} is for layer {layer} but the model has {num_layers} layers")
    if not 1 <= rank <= max_rank:
        raise check.fail(f"row {i}: rank {rank} must be in [1, max_lora_rank={max_rank}]")
    return module


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


def check_adapter_files(name: str, path: Path, max_rank: int, field: str) -> None:
    """What can be checked of an adapter without the model and without reading its weights: a
    directory in one of the two formats, and for PEFT a config we apply and tensors whose names,
    dtypes and ranks its headers give as the config says. The Engine stage runs it before it binds
    a name to the path for every replica (deployments/engine.py)."""
    check = AdapterCheck(name, field)
    if _holds(path, "model.lora_weights.npy", "model.lora_config.npy"):
        return
    if not _holds(path, "adapter_config.json", "adapter_model.safetensors"):
        raise check.fail(NOT_AN_ADAPTER)
    config = _peft_config(check, path / "adapter_config.json", max_rank)
    _check_targets(check, config, _peft_tensors(check, path / "adapter_model.safetensors", config["r"], None,
                                                None, read=False))


def load_adapter(name: str, path: Path, max_rank: int, shapes: dict[str, tuple[int, int]],
                 num_layers: int) -> LoRAAdapter:
    """Either format, checked whole against the model; InvalidRequestError says what is wrong."""
    if _holds(path, "model.lora_weights.npy", "model.lora_config.npy"):
        return load_trtllm_adapter(name, path, max_rank, shapes, num_layers)
    return load_peft_adapter(name, path, max_rank, shapes, num_layers)
