"""The engine loop in its own process behaves as the in-thread loop: streams equal offline generate,
leaving aborts, bad requests and adapters fail alone, and a dead process ends every stream."""
import asyncio
import os
import pickle
import signal
from dataclasses import fields

import numpy as np
import pytest

from app.engine import EngineConfig, EngineDeadError, InvalidRequestError, SamplingParams
from app.engine import engine_process, outputs
from app.engine.engine_process import EngineProcess
from app.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, pack_outputs, unpack_outputs
from tests.conftest import leave_a_stream_early, make_engine, random_prompts, stream_tokens
from tests.engine.test_lora import adapter_dirs, expected  # noqa: F401 - fixtures

PROMPTS = random_prompts(4, 5, 30, vocab=256, seed=21)


def _config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), kv_cache_config={"max_tokens": 4096, "tokens_per_block": 8})


@pytest.fixture(scope="module")
def process_engine(tiny_llama_dir):
    engine = EngineProcess(_config(tiny_llama_dir), cpu_threads=1)
    yield engine
    engine.shutdown()


async def _collect(engine, rid, prompt, params):
    tokens = []
    async for out in engine.generate(rid, prompt, params):
        tokens.extend(out.outputs[0].token_ids)
    return tokens


def test_streams_equal_offline_generate(process_engine, tiny_llama_dir):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in make_engine(tiny_llama_dir).generate(PROMPTS, params)]

    async def main():
        return await asyncio.gather(*(_collect(process_engine, f"s{i}", p, params) for i, p in enumerate(PROMPTS)))

    assert asyncio.run(main()) == expected


def test_leaving_aborts_and_bad_requests_fail_alone(process_engine):
    async def main():
        with pytest.raises(InvalidRequestError, match="top_k"):
            await _collect(process_engine, "bad", PROMPTS[0], SamplingParams(top_k=2 ** 63))
        return await leave_a_stream_early(process_engine, PROMPTS[0])

    assert asyncio.run(main()) and process_engine.healthy


def test_adapters_load_in_the_process(process_engine, tmp_path):
    async def main():
        with pytest.raises(InvalidRequestError, match="adapter 'x'"):
            await process_engine.add_lora("x", str(tmp_path))  # holds no adapter

    asyncio.run(main())
    assert not process_engine.has_lora("x") and process_engine.healthy


def test_an_adapter_added_mid_stream_serves_what_peft_generates(process_engine, adapter_dirs, expected):
    """The child prepares the adapter on its loader thread while a stream runs, then registers it."""
    prompts, out = expected
    greedy = SamplingParams(max_tokens=16, temperature=0.0)

    async def main():
        base = asyncio.create_task(stream_tokens(process_engine, "base", prompts[0], greedy))
        await process_engine.add_lora("a", str(adapter_dirs["a"]))
        return await base, await stream_tokens(process_engine, "adapted", prompts[0], greedy, "a")

    assert asyncio.run(main()) == (out[(0, None)], out[(0, "a")])
    assert process_engine.has_lora("a")


def test_a_killed_process_ends_every_stream(tiny_llama_dir):
    engine = EngineProcess(_config(tiny_llama_dir), cpu_threads=1)

    async def main():
        stream = engine.generate("long", PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(stream)
        os.kill(engine._process.pid, signal.SIGSTOP)  # frozen mid-request, then killed
        os.kill(engine._process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await _collect(engine, "late", PROMPTS[0], SamplingParams(max_tokens=2))

    asyncio.run(main())
    assert not engine.healthy
    engine.shutdown()


def test_a_reader_that_fails_ends_every_stream(tiny_llama_dir, monkeypatch):
    """Whatever the replica's reader of the child's messages trips on (here: delivering an output),
    the engine is dead at once, not stalled until the stuck check with new requests still taken."""
    engine = EngineProcess(_config(tiny_llama_dir), cpu_threads=1)

    def broken(*args):
        raise TypeError("a message this side cannot take")

    async def main():
        stream = engine.generate("long", PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(stream)
        monkeypatch.setattr(engine_process, "deliver", broken)

        async def drain():
            async for _ in stream:
                pass

        with pytest.raises(EngineDeadError, match="TypeError"):
            await asyncio.wait_for(drain(), 30)  # a stall, not a hang, where the reader dies silently
        with pytest.raises(EngineDeadError):
            await _collect(engine, "late", PROMPTS[0], SamplingParams(max_tokens=2))

    asyncio.run(main())
    assert not engine.healthy
    engine.shutdown()


def test_a_broken_start_is_one_sentence(tmp_path):
    with pytest.raises(RuntimeError, match="could not start"):
        EngineProcess(EngineConfig(model=str(tmp_path / "nothing")))


def test_outputs_cross_the_pipe_unchanged_plain_ones_as_tuples():
    """pack_outputs / unpack_outputs: a plain delta travels as a tuple and comes back equal; one
    with any extra (logprobs, alternatives, logits, metrics, an error, prompt logprobs, several
    outputs) travels whole. A field added to either dataclass must be taught to the packer."""
    plain = [RequestOutput("a", [CompletionOutput(0, [5, 6], None, 0.0)], False),
             RequestOutput("b", [CompletionOutput(2, [7], None, -1.5, "length", None)], True),
             RequestOutput("c", [CompletionOutput(0, [], None, 0.0, "stop", [3, 4])], True)]
    metrics = RequestMetrics(1, 2, 3, 4, 5, 6, 7, 8)
    rich = [RequestOutput("d", [CompletionOutput(0, [5], [-0.1], -0.1)], False),
            RequestOutput("e", [CompletionOutput(0, [5], None, 0.0, top_logprobs=[([5], [-0.1])])], False),
            RequestOutput("f", [CompletionOutput(0, [5], None, 0.0, generation_logits=np.zeros((1, 4)))], False),
            RequestOutput("g", [CompletionOutput(0, [5], None, 0.0, "length")], True, metrics),
            RequestOutput("h", [], True, error="the step failed"),
            RequestOutput("i", [CompletionOutput(0, [5], None, 0.0)], False, prompt_logprobs=[None, -0.5]),
            RequestOutput("j", [CompletionOutput(0, [5], None, 0.0)], False, context_logits=np.zeros((2, 4))),
            RequestOutput("k", [CompletionOutput(0, [5], None, 0.0), CompletionOutput(1, [6], None, 0.0)], False)]
    packed = pickle.loads(pickle.dumps(pack_outputs(plain + rich)))
    assert [type(p) for p in packed] == [tuple] * len(plain) + [RequestOutput] * len(rich)
    unpacked = unpack_outputs(packed)
    assert unpacked[:len(plain)] == plain
    assert [o.request_id for o in unpacked[len(plain):]] == [o.request_id for o in rich]
    assert {f.name for f in fields(RequestOutput)} == outputs._KNOWN_REQUEST_FIELDS
    assert {f.name for f in fields(CompletionOutput)} == outputs._KNOWN_OUTPUT_FIELDS


def test_a_shutdown_ends_open_streams_without_reporting_a_death(tiny_llama_dir, caplog):
    """Shutting the engine down is no crash: a stream still open ends as the in-thread engine's
    does ("shut down"), and nothing is logged as an error."""
    engine = EngineProcess(_config(tiny_llama_dir), cpu_threads=1)

    async def main():
        stream = engine.generate("long", PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(stream)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass

    with caplog.at_level("INFO", logger=engine_process.__name__):
        asyncio.run(main())
    assert not engine.healthy
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.records
