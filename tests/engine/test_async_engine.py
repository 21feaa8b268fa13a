"""The async front: streams, abort from the caller's side, failures that end streams."""
import asyncio
import time

import pytest

from app.engine import AsyncLLMEngine, EngineConfig, EngineDeadError, InvalidRequestError, SamplingParams
from tests.conftest import leave_a_stream_early, make_engine, random_prompts

PROMPTS = random_prompts(4, 5, 30, vocab=256, seed=21)


@pytest.fixture(scope="module")
def async_engine(tiny_llama_dir):
    engine = AsyncLLMEngine(EngineConfig(), engine=make_engine(tiny_llama_dir))
    yield engine
    engine.shutdown()


async def _collect(engine, rid, prompt, params):
    tokens, finals = [], []
    async for out in engine.generate(rid, prompt, params):
        tokens.extend(out.outputs[0].token_ids)
        finals.append(out.finished)
    return tokens, finals


def test_concurrent_streams_equal_offline_generate(async_engine, tiny_llama_dir):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in make_engine(tiny_llama_dir).generate(PROMPTS, params)]

    async def main():
        return await asyncio.gather(*(_collect(async_engine, f"s{i}", p, params) for i, p in enumerate(PROMPTS)))

    results = asyncio.run(main())
    assert [tokens for tokens, _ in results] == expected
    assert all(finals[-1] and not any(finals[:-1]) for _, finals in results)


def test_leaving_a_stream_aborts_and_frees_blocks(async_engine):
    assert asyncio.run(leave_a_stream_early(async_engine, PROMPTS[0]))


def test_invalid_request_raises_before_streaming(async_engine):
    async def main():
        async for _ in async_engine.generate("bad", [], SamplingParams()):
            pass

    with pytest.raises(InvalidRequestError, match="prompt"):
        asyncio.run(main())
    assert async_engine.healthy


def test_a_failing_step_fails_its_requests_and_repeated_failures_end_the_loop(tiny_llama_dir):
    """A step that raises fails the requests it computed (KV freed) and the engine goes on; steps
    failing MAX_FAILED_STEPS times in a row mean a lost device: the loop dies, nothing hangs."""
    from app.engine.errors import EngineStepError
    from app.engine.llm_engine import MAX_FAILED_STEPS

    engine = make_engine(tiny_llama_dir)
    healthy_execute = engine.runner.execute
    engine.runner.execute = lambda plan: (_ for _ in ()).throw(RuntimeError("device lost"))
    front = AsyncLLMEngine(EngineConfig(), engine=engine)

    async def batch(prefix):
        return await asyncio.gather(*(_collect(front, f"{prefix}{i}", p, SamplingParams(max_tokens=4)) for i, p in
                                      enumerate(PROMPTS)), return_exceptions=True)

    results = asyncio.run(batch("a"))
    assert all(isinstance(r, EngineStepError) for r in results), results
    assert front.healthy and front.stats().used_blocks == 0
    engine.runner.execute = healthy_execute  # one failed step in between does not count against the next
    assert all(len(tokens) == 4 for tokens, _ in asyncio.run(batch("b")))
    engine.runner.execute = lambda plan: (_ for _ in ()).throw(RuntimeError("device lost"))


    async def one(rid):  # one request: one step
        return (await asyncio.gather(_collect(front, rid, PROMPTS[0], SamplingParams()), return_exceptions=True))[0]

    errors = [type(asyncio.run(one(f"c{i}"))) for i in range(MAX_FAILED_STEPS)]
    assert errors == [EngineStepError] * (MAX_FAILED_STEPS - 1) + [EngineDeadError]
    assert not front.healthy

    async def after_death():  # nothing sent to a dead loop waits for it: each fails at once
        started = asyncio.get_running_loop().time()
        for call in (front.add_lora("x", "/nowhere"), _collect(front, "late", PROMPTS[0], SamplingParams())):
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(call, timeout=5)
        return asyncio.get_running_loop().time() - started

    assert asyncio.run(after_death()) < 1.0
    front.shutdown()


def test_a_stuck_step_makes_the_engine_unhealthy(tiny_llama_dir):
    import threading

    engine = make_engine(tiny_llama_dir)
    release = threading.Event()
    real_execute = engine.runner.execute

    def stuck(plan):
        release.wait(timeout=30)
        return real_execute(plan)

    engine.runner.execute = stuck
    front = AsyncLLMEngine(EngineConfig(), engine=engine, step_timeout_s=0.2)

    async def main():
        task = asyncio.create_task(_collect(front, "slow", PROMPTS[0], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0.6)
        unhealthy_while_stuck = not front.healthy
        release.set()
        tokens, _ = await task
        return unhealthy_while_stuck, tokens

    unhealthy_while_stuck, tokens = asyncio.run(main())
    assert unhealthy_while_stuck and len(tokens) == 2 and front.healthy
    front.shutdown()


def test_stats_and_health_read_during_load_never_fail(async_engine):
    """Other threads read only the snapshot the loop publishes: hammering stats(), has_lora() and
    healthy while streams run raises nothing (iterating the engine's live queues from another
    thread raised "deque mutated during iteration" at random) and sees the steps advance."""
    import threading

    stop, errors, steps = threading.Event(), [], set()

    def hammer():
        while not stop.is_set():
            try:
                steps.add(async_engine.stats().steps)
                assert async_engine.healthy and not async_engine.has_lora("none")
            except Exception as exc:  # noqa: BLE001 - collected for the assertion below
                errors.append(exc)
            # Let the loop's thread have the GIL: a reader that never gives it up stretched the load
            # to 54-75 s. About 4,000 reads still land across the load's 96 steps.
            time.sleep(0)

    async def load():
        params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
        prompts = random_prompts(16, 5, 40, vocab=256, seed=23)
        return await asyncio.gather(*(_collect(async_engine, f"h{i}", p, params) for i, p in enumerate(prompts)))

    readers = [threading.Thread(target=hammer) for _ in range(2)]
    for reader in readers:
        reader.start()
    try:
        results = asyncio.run(load())
    finally:
        stop.set()
        for reader in readers:
            reader.join()
    assert not errors and len(steps) > 2
    assert all(len(tokens) == 96 for tokens, _ in results)
