"""The engine benchmark's driver (tools/bench/engine_runner.py): when a request's TTFT starts."""
import time

from tests.conftest import make_engine, random_prompts
from tools.bench.engine_runner import run_engine
from tools.bench.workload import Workload

SLOW_STEP_S = 0.2


def slow_first_step(engine):
    """The engine, its first step made to take SLOW_STEP_S longer (a long prefill step on a GPU)."""
    step, slowed = engine.step, []

    def step_slowly_once():
        if not slowed:
            slowed.append(True)
            time.sleep(SLOW_STEP_S)
        return step()

    engine.step = step_slowly_once
    return engine


def test_a_request_due_during_a_step_counts_its_wait_for_that_step(tiny_llama_dir):
    """Requests 1 and 2 are due 10 ms in, while request 0's (slow) first step runs: the loop takes
    them only once it ends, but their TTFT counts from when they were due, as a serving engine's
    clients would see it (counted from when the loop took them, it would read a few ms)."""
    engine = slow_first_step(make_engine(tiny_llama_dir))
    prompts = random_prompts(3, 8, 16, engine.limits.vocab_size, seed=1)
    workload = Workload(prompts, output_len=2, ignore_eos=True, arrivals_s=[0.0, 0.01, 0.01], concurrency=3)
    steps = []
    result = run_engine(engine, workload, on_step=lambda started, took, added, outputs: steps.append((took, added)))
    assert steps[0][0] >= SLOW_STEP_S and steps[0][1] == 1  # request 0 alone in the slow step
    assert result.ttft_ms["p50"] >= (SLOW_STEP_S - 0.01) * 1e3, result.ttft_ms


def test_a_request_held_back_by_the_concurrency_limit_counts_from_when_a_slot_freed(tiny_llama_dir):
    """One slot, two requests due at once: request 1 waits for request 0 to finish, as a client
    limited to one stream would, and its TTFT counts from then, not from the run's start."""
    engine = slow_first_step(make_engine(tiny_llama_dir))
    prompts = random_prompts(2, 8, 16, engine.limits.vocab_size, seed=2)
    result = run_engine(engine, Workload(prompts, output_len=2, ignore_eos=True, arrivals_s=None, concurrency=1))
    assert result.ttft_ms["p99"] >= SLOW_STEP_S * 1e3  # request 0, through the slow step
    assert result.ttft_ms["p50"] < SLOW_STEP_S / 2 * 1e3, result.ttft_ms  # request 1, its own step only
