"""FP8 linear layers (quantization: fp8): E4M3 weights with per-channel scales and activations
quantized per token, against full precision. The tolerances are FP8's: E4M3 keeps 3 mantissa bits
(about 6% per element), so outputs are close to, not equal to, float32's."""
import pytest
import torch

from app.config import ServiceConfig
from app.engine import EngineConfig, SamplingParams
from app.engine.llm_engine import merge_outputs
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
