"""FP8 linear layers (quantization: fp8): E4M3 weights with per-channel scales and activations
quantized per token, against full precision; and the FP8 KV cache (kv_cache_config.dtype fp8). The
tolerances are FP8's: E4M3 keeps 3 mantissa bits (about 6% per element), so outputs are close to,
not equal to, float32's."""
import pytest
import torch

from app.config import ConfigError, ServiceConfig, parse_config
from app.engine import EngineConfig, KvCacheConfig, LLMEngine, SamplingParams
from app.engine.outputs import merge_outputs
from app.engine.models.layers import FP8, MergedLinear, fp8_linear
from app.text import Tokenizer
from tests.conftest import make_engine


def test_a_quantized_linear_stays_within_fp8_precision_of_the_float_one():
    torch.manual_seed(0)
    layer = MergedLinear(256, [128, 64], bias=False, dtype=torch.float32)
    layer.weight.normal_(0, 0.05)
    layer.weight[:, 7] *= 40  # an outlier input channel: per-channel weight scales absorb it row by row
    x = torch.randn(33, 256)
    x[5] *= 100  # an outlier token: its own scale, so the other rows keep their precision
    expected = x @ layer.weight.T
    layer.quantize_fp8()
    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (1, 192)
    got = layer(x)
    relative = (got - expected).norm(dim=1) / expected.norm(dim=1)
    assert relative.max() < 0.06, relative.max()
    assert torch.equal(got, fp8_linear(x, layer.weight, layer.weight_scale, None))


def test_an_fp8_engine_agrees_with_float32_on_smollm2(smollm2_dir):
    """Teacher-forced over float32's greedy answer: the FP8 engine's top choice is float32's at
    >= 85% of positions and the answer's logprobs move by < 0.15 on average (SmolLM2-135M, a small
    model, is harder on FP8 than an 8B one). The lm_head and embeddings stay in float32."""
    tokenizer = Tokenizer(smollm2_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Explain photosynthesis briefly."}])
    answer = make_engine(smollm2_dir).generate([prompt], SamplingParams(max_tokens=48, temperature=0.0))[0]
    text = prompt + answer.outputs[0].token_ids
    scored = {}
    for quantization in (None, "fp8"):
        engine = make_engine(smollm2_dir, quantization=quantization)
        scored[quantization] = engine.generate([text], SamplingParams(max_tokens=1, temperature=0.0,
                                                                      prompt_logprobs=1))[0]
    model = engine.runner.shard.model
    assert model.layers[0].mlp.gate_up_proj.weight.dtype == FP8 and model.lm_head.weight.dtype == torch.float32
    positions = range(len(prompt), len(text))
    agree = sum(scored["fp8"].prompt_top_logprobs[i][0][0] == text[i] for i in positions) / len(positions)
    drift = sum(abs(scored["fp8"].prompt_logprobs[i] - scored[None].prompt_logprobs[i]) for i in positions)
    assert agree >= 0.85 and drift / len(positions) < 0.15, (agree, drift / len(positions))


def test_quantization_is_checked_where_it_is_set():
    with pytest.raises(ValueError, match="quantization must be fp8"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization is read by backend torch"):
        ServiceConfig(backend="trtllm", quantization="fp8")
    assert ServiceConfig(quantization="fp8").engine_config().quantization == "fp8"


def test_adapters_apply_over_fp8_linears(smollm2_dir, lora_root):
    """An adapter's delta rides on the FP8 base (it reads the 16-bit input): with the adapter, the
    FP8 engine's greedy answer is teacher-forced float32's at >= 85% of positions, as without."""
    name, path = "pirate", lora_root / "pirate"
    prompt = Tokenizer(smollm2_dir).apply_chat_template([{"role": "user", "content": "Tell me about ships."}])
    engines = {}
    for quantization in (None, "fp8"):
        engines[quantization] = make_engine(smollm2_dir, quantization=quantization)
        engines[quantization].add_lora(name, path)

    def run(engine, ids, params, adapter=name):
        engine.add_request("r", ids, params, adapter_id=adapter)
        merged = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                merged = merge_outputs(merged, out)
        return merged
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    answer = run(engines[None], prompt, greedy).outputs[0].token_ids
    plain = run(engines[None], prompt, greedy, None).outputs[0].token_ids
    assert answer != plain  # the adapter changes the answer
    text = prompt + answer
    scored = run(engines["fp8"], text, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    agree = sum(scored.prompt_top_logprobs[i][0][0] == text[i] for i in range(len(prompt), len(text)))
    assert agree / len(answer) >= 0.85, agree / len(answer)


def test_an_fp8_kv_cache_holds_twice_the_tokens_of_bf16_in_the_same_memory(tiny_llama_dir, monkeypatch):
    """The pool is sized from the same free memory (here a fixed 2 MiB): in FP8, twice the blocks."""
    from app.engine.worker import ModelShard

    budget = 2 << 20
    monkeypatch.setattr(ModelShard, "_free_memory", lambda self, graph_bytes: budget)
    shards = {}
    for kv_dtype in ("auto", "fp8"):
        config = EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16",
                              kv_cache_config={"dtype": kv_dtype, "free_gpu_memory_fraction": 1.0})
        shards[kv_dtype] = ModelShard(config, tiny_llama_dir, 512, torch.device("cpu"))
    bf16, fp8 = shards["auto"], shards["fp8"]
    assert (bf16.kv_cache.dtype, fp8.kv_cache.dtype) == (torch.bfloat16, FP8)
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert fp8.num_blocks == 2 * bf16.num_blocks == 2 * budget // (bf16.kv_bytes_per_token * bf16.block_size)
    block_bytes = bf16.block_size * bf16.kv_bytes_per_token
    assert budget <= bf16.kv_cache.nbytes <= budget + block_bytes  # the pool and its scratch block
    assert budget <= fp8.kv_cache.nbytes <= budget + block_bytes


PASSAGE = ("The history of the bicycle begins in the early nineteenth century, when inventors in Germany and "
           "France built two-wheeled machines that riders pushed along with their feet. Pedals attached to the "
           "front wheel came in the 1860s, and the tall penny-farthing followed, fast but dangerous. The safety "
           "bicycle of the 1880s, with two wheels of equal size and a chain driving the rear one, settled the "
           "shape that most bicycles still have. Pneumatic tyres made the ride comfortable, and within a few "
           "years cycling clubs, racing and touring spread across Europe and America. Bicycles changed how "
           "people lived: workers could live farther from factories, women gained a new independence, and "
           "roads were paved to suit riders before cars arrived. Today engineers still refine the frame, the "
           "gears and the brakes, while cities build lanes so that more people can ride safely to work.")


def test_an_fp8_kv_cache_agrees_with_the_models_dtype_on_smollm2(smollm2_dir):
    """SmolLM2 in float32, its cache in float32 (auto) and in FP8 with scales of 1.0 (this model's
    keys and values stay within 20 in magnitude, far inside E4M3's 448). A 220-token prompt
    prefilled whole: FP8's top choice is auto's at >= 90% of its positions (measured 0.963) and its
    tokens' logprobs move by < 0.15 on average (measured 0.083). Then 48 greedy tokens, decode steps
    reading the FP8 cache: given FP8's answer, auto's top choice is FP8's token at >= 85% of it
    (measured 0.94; the two answers part after 14 tokens). The greedy request hits the blocks the
    first one left (its prefill reads the cached prefix, dequantized): its first token and logprob
    are the whole prefill's, because a prefill attends to its own keys as the cache holds them."""
    text = Tokenizer(smollm2_dir).apply_chat_template(
        [{"role": "user", "content": PASSAGE + " Summarise this in three sentences."}])
    engines, scored, answers = {}, {}, {}
    for kv_dtype in ("auto", "fp8"):
        engines[kv_dtype] = engine = _kv_engine(smollm2_dir, kv_dtype)
        scored[kv_dtype] = engine.generate([text], SamplingParams(max_tokens=1, temperature=0.0, logprobs=True,
                                                                  prompt_logprobs=1))[0]
        answers[kv_dtype] = engine.generate([text], SamplingParams(max_tokens=48, temperature=0.0, logprobs=True,
                                                                   ignore_eos=True))[0]
        hit, whole = answers[kv_dtype], scored[kv_dtype]
        assert hit.metrics.kv_cache_reused_blocks > 0
        assert hit.outputs[0].token_ids[0] == whole.outputs[0].token_ids[0]
        assert hit.outputs[0].logprobs[0] == pytest.approx(whole.outputs[0].logprobs[0], abs=1e-4)
    assert engines["fp8"].runner.shard.kv_cache.dtype == FP8
    positions = range(1, len(text))
    agree = sum(scored["fp8"].prompt_top_logprobs[i][0][0] == scored["auto"].prompt_top_logprobs[i][0][0]
                for i in positions) / len(positions)
    drift = sum(abs(scored["fp8"].prompt_logprobs[i] - scored["auto"].prompt_logprobs[i])
                for i in positions) / len(positions)
    answer = answers["fp8"].outputs[0].token_ids
    forced = engines["auto"].generate([text + answer], SamplingParams(max_tokens=1, temperature=0.0,
                                                                      prompt_logprobs=1))[0]
    followed = sum(forced.prompt_top_logprobs[len(text) + i][0][0] == token
                   for i, token in enumerate(answer)) / len(answer)
    assert agree >= 0.9 and drift < 0.15 and followed >= 0.85, (agree, drift, followed)


def _kv_engine(model_dir, kv_dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_config={"max_tokens": 4096, "tokens_per_block": 16,
                                                                          "dtype": kv_dtype}))


def test_kv_cache_dtype_is_checked_where_it_is_set():
    from app.backends.trtllm import llm_kwargs

    with pytest.raises(ValueError, match="kv_cache_config.dtype must be auto or fp8, got 'int8'"):
        EngineConfig(kv_cache_config={"dtype": "int8"})
    with pytest.raises(ConfigError, match="key 'kv_cache_config.dtype'"):
        parse_config({"kv_cache_config": {"dtype": "float16"}})
    with pytest.raises(ConfigError, match="kv_cache_config.dtype fp8 is read by backends torch and trtllm"):
        parse_config({"backend": "triton", "triton": {"engine_dir": "/e"}, "kv_cache_config": {"dtype": "fp8"}})
    assert parse_config({}).kv_cache_config.dtype == KvCacheConfig.dtype == "auto"
    assert parse_config({"kv_cache_config": {"dtype": "fp8"}}).engine_config().kv_cache_config.dtype == "fp8"
    trtllm = parse_config({"backend": "trtllm", "kv_cache_config": {"dtype": "fp8"}})
    assert llm_kwargs(trtllm, "/models/m")["kv_cache_config"]["dtype"] == "fp8"  # TensorRT-LLM's KvCacheConfig.dtype
