"""Random LoRA adapters for a model, made with peft, for benchmarks that spread requests over them."""
from __future__ import annotations

from pathlib import Path

import torch


def make_adapters(model_dir: Path, out_dir: Path, count: int, rank: int = 8,
                  targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = {}
    for i in range(count):
        torch.manual_seed(i)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                               LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                          init_lora_weights=False))
        paths[f"bench-{i}"] = out_dir / f"bench-{i}"
        model.save_pretrained(paths[f"bench-{i}"])
    return paths
