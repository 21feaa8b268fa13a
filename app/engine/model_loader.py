"""Load model weights from a model directory (app/engine/model_dir.py finds or converts it).

FP8 checkpoints (ModelOpt, compressed-tensors) load as they are stored; other quantized
checkpoints are refused.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from app.engine.models.kernels import select_kernels
from app.engine.models.layers import FP8
from app.engine.models.llama import LlamaForCausalLM, ModelConfig
from app.engine.parallel import SINGLE, ParallelLayout, TensorParallel

logger = logging.getLogger(__name__)

# FP8 (E4M3) checkpoints that load as they are: weights with per-tensor or per-output-channel scales.
MODELOPT_FP8_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")
COMPRESSED_TENSORS_FP8_FORMATS = ("float-quantized", "naive-quantized")  # both store E4M3 values unpacked
SUPPORTED_QUANTIZATION = ("this engine loads 16- and 32-bit floating-point weights (quantization: fp8 quantizes "
                          "them at load) and FP8 checkpoints with per-tensor or per-channel weight scales "
                          f"(ModelOpt quant_algo {' or '.join(MODELOPT_FP8_ALGOS)}; compressed-tensors "
                          f"{' or '.join(COMPRESSED_TENSORS_FP8_FORMATS)}, 8-bit float weights, strategy tensor "
                          "or channel)")


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files to read: exactly those model.safetensors.index.json names where there
    is one (a Mistral snapshot also ships consolidated.safetensors, with other tensor names)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in names if not (model_dir / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{model_dir}: model.safetensors.index.json names {len(missing)} shard(s) that "
                                    f"are not there: {', '.join(missing[:4])} (an unfinished download?)")
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    # Without an index too: Mistral's consolidated file holds the same weights under other names.
    return [f for f in files if not f.name.startswith("consolidated")] or files


def check_checkpoint_quantization(model_dir: Path) -> None:
    """Refuse, in one sentence naming it, any quantization_config (or ModelOpt hf_quant_config.json)
    but an FP8 one whose tensors load as they are. Whether a linear is FP8 is then read from the
    checkpoint itself: its weight comes with a weight_scale (the layers a checkpoint excludes, such as
    the lm_head, have none and load as 16-bit weights)."""
    config = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
    modelopt_file = model_dir / "hf_quant_config.json"
    if not config and modelopt_file.is_file():  # older ModelOpt exports describe it only there
        config = {"quant_method": "modelopt", **json.loads(modelopt_file.read_text())}
    if not config:
        return
    if isinstance(config.get("quantization"), dict):  # hf_quant_config.json's layout: the fields one level down
        config = {**config, **config["quantization"]}
    method = config.get("quant_method")
    if method == "modelopt":
        algo = str(config.get("quant_algo")).upper()
        problem = None if algo in MODELOPT_FP8_ALGOS else f"a ModelOpt quant_algo {config.get('quant_algo')} checkpoint"
    elif method == "compressed-tensors":
        problem = _compressed_tensors_problem(config)
    else:
        problem = f"a {method or 'quantized'} checkpoint"
    if problem:
        raise ValueError(f"{model_dir}: {problem}; {SUPPORTED_QUANTIZATION}")
    if config.get("kv_cache_quant_algo") or config.get("kv_cache_scheme"):
        logger.warning("%s: the checkpoint's KV-cache quantization (kv_cache_quant_algo, kv_cache_scheme) is not "
                       "applied: its k_scale and v_scale tensors are not read", model_dir)


def _compressed_tensors_problem(config: dict) -> str | None:
    """What a compressed-tensors quantization_config asks that this engine does not load, if anything."""
    sparsity = config.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        return f"a compressed-tensors checkpoint with sparsity_config format {sparsity['format']}"
    if config.get("transform_config"):  # rotations the weights were trained against
        return "a compressed-tensors checkpoint with a transform_config"
    for name, group in (config.get("config_groups") or {}).items():
        where = f"a compressed-tensors checkpoint with config_groups.{name}"
        if group.get("format"):
            if group["format"] not in COMPRESSED_TENSORS_FP8_FORMATS:
                return f"{where}.format {group['format']}"
        elif config.get("format") not in COMPRESSED_TENSORS_FP8_FORMATS:  # the checkpoint's, for every group
            return f"a compressed-tensors checkpoint with format {config.get('format')}"
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        if not _is_fp8(weights, ("tensor", "channel")) or weights.get("dynamic") or weights.get("symmetric") is False:
            return f"{where}.weights {_scheme(weights)}"
        if inputs and not _is_fp8(inputs, ("tensor", "token")):
            return f"{where}.input_activations {_scheme(inputs)}"
        if group.get("output_activations"):
            return f"{where}.output_activations {_scheme(group['output_activations'])}"
    return None


def _is_fp8(args: dict, strategies: tuple[str, ...]) -> bool:
    return args.get("num_bits") == 8 and args.get("type") == "float" and args.get("strategy") in strategies


def _scheme(args: dict) -> str:
    return "(" + ", ".join(f"{key} {args.get(key)}" for key in ("num_bits", "type", "strategy", "symmetric",
                                                                  "dynamic")) + ")"


def read_model_config(model_dir: Path) -> ModelConfig:
    config = json.loads((model_dir / "config.json").read_text())
    generation = model_dir / "generation_config.json"
    if generation.is_file():  # instruct models list their end-of-turn ids here
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            config["eos_token_id"] = eos
    return ModelConfig.from_hf(config)


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, max_positions: int,
               load_format: str = "auto", layout: ParallelLayout = ParallelLayout(),
               tp: TensorParallel = SINGLE, quantization: str | None = None) -> LlamaForCausalLM:
    """This rank's part of the model (all of it without parallelism). `load_format` "dummy" builds
    the shape from config.json alone with random weights (vLLM's load_format=dummy): for measuring
    speed without downloading weights. An FP8 checkpoint's linears load as stored (E4M3 and their
    scales); `quantization` "fp8" quantizes the decoder layers' 16-bit linears once loaded."""
    cfg = read_model_config(model_dir)
    with torch.device(device):
        model = LlamaForCausalLM(cfg, max_positions, dtype, select_kernels(device, dtype), layout, tp)
    if load_format == "dummy":
        with torch.no_grad():
            generator = torch.Generator(device=device).manual_seed(0)
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.fill_(1.0)
                elif param.dim() > 1:
                    param.normal_(0.0, 0.02, generator=generator)
                else:
                    param.zero_()
        model.finish_loading(quantization)
        return model.eval()
    check_checkpoint_quantization(model_dir)
    with torch.no_grad():
        for param in model.parameters():  # whatever no checkpoint tensor overwrites stays NaN, and is found
            param.fill_(float("nan"))
        _read_checkpoint(model, checkpoint_files(model_dir), dtype, device)
        unloaded = [name for name, param in model.named_parameters() if torch.isnan(param).any()]
    if unloaded:
        raise ValueError(f"{model_dir}: the checkpoint left {len(unloaded)} parameter(s) without weights: "
                         f"{', '.join(unloaded[:4])} (an unfinished download, or another architecture?)")
    model.finish_loading(quantization)
    return model.eval()


def _read_checkpoint(model: LlamaForCausalLM, files: list[Path], dtype: torch.dtype, device: torch.device) -> None:
    """Every tensor this rank holds, into place. A linear whose weight comes with a weight_scale is
    held in FP8 first; FP8 weights stay FP8, their scales reach float32 without a 16-bit rounding,
    and everything else takes the model's dtype."""
    model.hold_fp8(_tensor_names(files, ".weight_scale"))
    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                if model.hf_target(name) is None:  # read only what this rank holds
                    continue
                tensor = f.get_tensor(name)
                if tensor.dtype != FP8 and not name.endswith(".weight_scale"):
                    tensor = tensor.to(dtype)
                _load_tensor(model, name, tensor)


def _tensor_names(files: list[Path], suffix: str) -> list[str]:
    names = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            names += [name for name in f.keys() if name.endswith(suffix)]
    return names


def _load_tensor(model: LlamaForCausalLM, name: str, tensor: torch.Tensor) -> None:
    try:
        model.load_hf_tensor(name, tensor)
    except (AttributeError, RuntimeError, ValueError) as exc:  # a name, shape or dtype the model has no place for
        raise ValueError(f"checkpoint tensor {name!r} {list(tensor.shape)} does not fit this model "
                         f"({type(exc).__name__}: {exc})") from None
