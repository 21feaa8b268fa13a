"""When the overlap scheduler plans its next step (app/engine/step_clock.py), and the loop that
waits for it. The device times the clock learns from come from CUDA events (tests/engine/test_gpu.py
runs it there); here they are given."""
import asyncio
import time

import pytest

from app.engine import SamplingParams
from app.engine.async_engine import AsyncLLMEngine
from app.engine.step_clock import ANCHOR_S, HOST_SAFETY_S, RECENT, StepClock
from tests.conftest import make_engine


def test_plans_at_once_until_a_step_of_the_computing_steps_size_was_timed():
    clock = StepClock()
    clock.started(200, at=10.0)
    assert clock.seconds_to_plan(10.0) == 0.0
    clock.timed(2048, 0.050)  # another size
    clock.started(200, at=10.0)
    assert clock.seconds_to_plan(10.0) == 0.0
    clock.timed(250, 0.010)  # 128-255 tokens: the same size
    clock.started(200, at=10.0)
    assert clock.seconds_to_plan(10.0) == pytest.approx(0.010 - HOST_SAFETY_S)


def test_plans_before_the_step_ends_by_the_largest_recent_lead_the_host_needed():
    """A lead: planning until the first kernel is queued, plus what queuing the rest takes longer than
    the device takes to compute it."""
    clock = StepClock()
    clock.timed(2048, 0.050)
    clock.planned(2048, 0.007, 0.034, late=False)  # queued faster than computed: 7 ms
    clock.planned(2048, 0.004, 0.055, late=False)  # 5 ms slower than computed: 4 + 5 ms
    clock.planned(256, 0.003, 0.001, late=False)  # a size never timed: all of its queuing, 4 ms
    clock.started(2048, at=100.0)
    plan_at = 100.0 + 0.050 - 0.009 - HOST_SAFETY_S
    assert clock.seconds_to_plan(100.0) == pytest.approx(plan_at - 100.0)
    assert clock.seconds_to_plan(100.030) == pytest.approx(plan_at - 100.030)
    assert clock.seconds_to_plan(100.049) == 0.0  # past it: plan now
    for _ in range(RECENT):  # the largest lead is forgotten once RECENT others follow it
        clock.planned(2048, 0.001, 0.030, late=False)
    clock.started(2048, at=100.0)
    assert clock.seconds_to_plan(100.0) == pytest.approx(0.050 - 0.001 - HOST_SAFETY_S)
    assert (clock.queued, clock.queued_late) == (3 + RECENT, 0)


def test_the_estimate_is_the_shortest_recent_step_of_the_size():
    """Planning early costs an arrival a step; planning late idles the device: the shortest wins."""
    clock = StepClock()
    clock.timed(2100, 0.030)  # 2,048-4,095 tokens: one size
    for _ in range(RECENT):
        clock.timed(2048, 0.050)
    clock.started(2048, at=0.0)
    assert clock.seconds_to_plan(0.0) == pytest.approx(0.050 - HOST_SAFETY_S)  # 30 ms: more than RECENT ago
    clock.timed(1100, 0.045)
    clock.started(1500, at=0.0)
    assert clock.seconds_to_plan(0.0) == pytest.approx(0.045 - HOST_SAFETY_S)
    assert clock.estimates == {1024: 0.045, 2048: 0.050}


def test_with_nothing_on_the_device_the_next_step_is_planned_at_once():
    clock = StepClock()
    clock.timed(64, 0.010)
    clock.started(64, at=0.0)
    assert clock.seconds_to_plan(0.0) > 0.0
    clock.stopped()
    assert clock.seconds_to_plan(0.0) == 0.0
    clock.planned(64, 0.001, 0.001, late=True)
    assert (clock.queued, clock.queued_late) == (1, 1)


class ReadBack:
    """A read back step's DeviceSample as StepClock.ended_at reads it: `device_s`, its end on the
    device's clock (CUDA events, which cannot run here); `finished_at`, the host's stamp of its wait
    for it (None: the step had ended before the host asked)."""

    def __init__(self, device_s: float, finished_at: float | None = None):
        self.device_s, self.finished_at = device_s, finished_at

    def device_seconds_since(self, earlier) -> float:
        return self.device_s - earlier.device_s


def test_a_step_the_host_did_not_wait_for_ended_when_the_device_clock_says():
    """Not when it was read back: the host may have spent the time since queuing the next step
    (planning from that moment idled the device). The stamp that implies the earliest ends counts,
    since a wait's stamp comes a wake-up late, never early, until it is ANCHOR_S old."""
    clock = StepClock()
    before = time.monotonic()
    assert before <= clock.ended_at(ReadBack(5.0)) <= time.monotonic()  # nothing to count from yet: now
    assert clock.ended_at(ReadBack(10.000, finished_at=100.000)) == 100.000
    assert clock.ended_at(ReadBack(10.050)) == pytest.approx(100.050)
    assert clock.ended_at(ReadBack(10.100, finished_at=100.108)) == pytest.approx(100.100)  # woke 8 ms late
    assert clock.ended_at(ReadBack(10.150, finished_at=100.149)) == 100.149  # the first stamp was 1 ms late
    assert clock.ended_at(ReadBack(10.200)) == pytest.approx(100.199)
    # Past ANCHOR_S the next stamp anchors, late or not: the host's and the device's clocks drift apart.
    late = ReadBack(10.150 + ANCHOR_S + 0.1, finished_at=100.149 + ANCHOR_S + 0.1 + 0.003)
    assert clock.ended_at(late) == late.finished_at
    assert clock.ended_at(ReadBack(late.device_s + 0.05)) == pytest.approx(late.finished_at + 0.05)


async def _output_times(engine: AsyncLLMEngine, prompt, max_tokens: int, abort_after: int | None = None) -> list:
    """When each output came; with `abort_after`, the stream is left after that many (an abort)."""
    times = []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for _ in engine.generate(f"r{max_tokens}", prompt, params):
        times.append(time.monotonic())
        if len(times) == abort_after:
            break
    return times


def test_the_loop_holds_the_next_step_until_the_plan_time_but_takes_an_abort_at_once(tiny_llama_dir):
    """Overlap and late planning turned on here (on CPU a launched step has computed already, so
    the clock times none of them). Told that a one-row step takes 1 s on the device, the loop plans
    each decode step about 1 s after the one before, but it still applies commands meanwhile: an
    abort sent during the wait takes the request out at once, not at the plan time."""
    llm = make_engine(tiny_llama_dir, late_planning=True)
    llm.overlap = True
    llm.clock.timed(1, 1.0)
    engine = AsyncLLMEngine(llm.config, engine=llm)
    try:
        times = asyncio.run(_output_times(engine, [5, 6, 7, 8], max_tokens=3))
        assert len(times) == 3 and all(b - a > 0.8 for a, b in zip(times, times[1:])), times
        left = asyncio.run(_output_times(engine, [5, 6, 7, 8], max_tokens=50, abort_after=1))[-1]
        while "r50" in llm.requests and time.monotonic() - left < 5.0:  # aborting takes it out, blocks and all
            time.sleep(0.01)
        assert "r50" not in llm.requests and time.monotonic() - left < 0.5
    finally:
        engine.shutdown()
