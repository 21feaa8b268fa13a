"""Random LoRA adapters for a model, written in PEFT's format from the model's config.json alone (so
dummy-weight shapes work too), for benchmarks that spread requests over them."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from app.engine.model_loader import read_model_config
from app.engine.models.llama import LlamaForCausalLM

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapters(model_dir: Path, out_dir: Path, count: int, rank: int = 8,
                  targets=ALL_PROJECTIONS) -> dict[str, Path]:
    """`count` adapters of `rank` on `targets` (those the model has), every layer; B is non-zero, so
    each adapter changes the outputs and costs what a trained one does."""
    cfg = read_model_config(model_dir)
    shapes = {name: shape for name, shape in LlamaForCausalLM.lora_shapes(cfg).items() if name in targets}
    paths = {}
    for i in range(count):
        generator = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(cfg.num_layers):
            for name, (fan_in, fan_out) in shapes.items():
                block = LlamaForCausalLM.PROJECTIONS[name][0].split(".")[0]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * fan_in ** -0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
        path = paths[f"bench-{i}"] = out_dir / f"bench-{i}"
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, path / "adapter_model.safetensors")
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                  "target_modules": list(shapes), "base_model_name_or_path": str(model_dir)}
        (path / "adapter_config.json").write_text(json.dumps(config))
    return paths
