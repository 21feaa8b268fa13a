"""Backend contract tests: the adapters against fakes of tensorrt_llm and tritonserver."""
import sys
from pathlib import Path

import pytest

FAKES = str(Path(__file__).resolve().parents[1] / "fakes")


@pytest.fixture(autouse=True, scope="package")
def fakes_importable():
    sys.path.insert(0, FAKES)
    yield
    sys.path.remove(FAKES)
    for name in [m for m in sys.modules if m.split(".")[0] in ("tensorrt_llm", "tritonserver")]:
        del sys.modules[name]


def service_config(model_dir, **overrides):
    from app.config import parse_config

    data = {"model": str(model_dir), "max_seq_len": 1024, "max_batch_size": 16,
            "kv_cache_config": {"max_tokens": 8192, "tokens_per_block": 32}}
    return parse_config({**data, **overrides})


def collect(backend, prompt, params, adapter=None, request_id="r", stop_after=None):
    """Run one request through a backend; return (deltas, merged output)."""
    import asyncio

    from app.engine.outputs import merge_outputs

    async def run():
        deltas, merged = [], None
        async for out in backend.generate(request_id, prompt, params, adapter):
            deltas.append(out)
            merged = merge_outputs(merged, out)
            if stop_after is not None and len(deltas) >= stop_after:
                break
        await asyncio.sleep(0.2)  # let an abort reach the backend before the loop closes
        return deltas, merged

    return asyncio.run(run())


def engine_reference(model_dir, prompt, params, adapter_path=None):
    """The portable engine's own answer for the same request: what every backend must return."""
    from app.engine.outputs import merge_outputs
    from tests.conftest import make_engine

    engine = make_engine(model_dir, max_tokens=8192, tokens_per_block=32, max_batch_size=16)
    if adapter_path is not None:
        engine.add_lora("a", str(adapter_path))
    engine.add_request("ref", prompt, params, "a" if adapter_path else None)
    merged = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            merged = merge_outputs(merged, out)
    return merged


def greedy_stream(backend, hf_model, prompt, max_tokens=24):
    """Stream a greedy request with logprobs through a backend and check it against transformers:
    the same tokens, several deltas, only the last one finished. Returns the merged output."""
    from app.engine import SamplingParams
    from tests.conftest import hf_greedy

    deltas, merged = collect(backend, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True))
    out = merged.outputs[0]
    assert out.token_ids == hf_greedy(hf_model, prompt, max_tokens)
    assert len(deltas) > 1 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert len(out.logprobs) == len(out.token_ids)
    return merged


def check_logits_stream(deltas, merged, ref, prompt_len: int, vocab: int, tokens: int) -> None:
    """A backend's logits as the torch engine sends them: context rows on the first delta only, one
    generation row per token in every delta, the whole equal (shapes and values) to `ref`'s."""
    import numpy as np

    assert deltas[0].context_logits is not None and all(d.context_logits is None for d in deltas[1:])
    assert merged.context_logits.dtype == np.float32 and merged.context_logits.shape == (prompt_len, vocab)
    np.testing.assert_array_equal(merged.context_logits, ref.context_logits)
    for d in deltas:
        for c in d.outputs:
            assert (0 if c.generation_logits is None else len(c.generation_logits)) == len(c.token_ids)
    out = merged.outputs[0]
    assert out.token_ids == ref.outputs[0].token_ids and out.generation_logits.shape == (tokens, vocab)
    np.testing.assert_array_equal(out.generation_logits, ref.outputs[0].generation_logits)


def check_sampled_n_logits(backend, model_dir, prompt) -> None:
    """Two seeded sampled outputs asking generation logits: tokens and rows equal the torch engine's."""
    import numpy as np

    from app.engine import SamplingParams

    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=2, return_generation_logits=True)
    _, merged = collect(backend, prompt, sampled)
    ref = engine_reference(model_dir, prompt, sampled)
    assert merged.context_logits is None
    for ours, theirs in zip(merged.outputs, ref.outputs, strict=True):
        assert ours.token_ids == theirs.token_ids
        np.testing.assert_array_equal(ours.generation_logits, theirs.generation_logits)


def check_refused_as_the_engine_refuses(backend, prompt, params, limits, field: str) -> None:
    """The backend refuses the request with the torch engine's own 400, word for word."""
    from app.engine.errors import InvalidRequestError
    from app.engine.sampling_params import validate_request

    with pytest.raises(InvalidRequestError) as err:
        collect(backend, prompt, params)
    with pytest.raises(InvalidRequestError) as torch_err:
        validate_request(prompt, params, limits)
    assert err.value.field == field and err.value.status == 400 and "max_logits_floats" in err.value.message
    assert str(err.value) == str(torch_err.value)


def check_logit_bias(backend, model_dir, prompt, sent_as_expected=lambda: True) -> None:
    """-100 on the greedy choice bans it, +100 on another token forces it: the torch engine's tokens
    for the same logit_bias. `sent_as_expected` checks each request as the backend sent it."""
    from app.engine import SamplingParams

    greedy = engine_reference(model_dir, prompt, SamplingParams(max_tokens=6, temperature=0.0)).outputs[0]
    for bias in ({greedy.token_ids[0]: -100.0}, {1780: 100.0}):
        params = SamplingParams(max_tokens=6, temperature=0.0, logit_bias=bias)
        _, merged = collect(backend, prompt, params)
        assert merged.outputs[0].token_ids == engine_reference(model_dir, prompt, params).outputs[0].token_ids
        assert merged.outputs[0].token_ids != greedy.token_ids and sent_as_expected()
