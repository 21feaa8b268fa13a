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

    from app.engine.llm_engine import merge_outputs

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
    from app.engine.llm_engine import merge_outputs
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
