"""The engine benchmark's driver (tools/bench/engine_runner.py): when a request's TTFT starts."""
import time

from tests.conftest import make_engine, random_prompts
from tools.bench.engine_runner import run_engine
from tools.bench.workload import Workload

SLOW_STEP_S = 0.2


def slow_step(engine, which: int):
    """The engine, its step number `which` (from 0) made to take SLOW_STEP_S longer (a long prefill
    step on a GPU)."""
    step, taken = engine.step, []

    def step_slowly_once():
        if len(taken) == which:
            time.sleep(SLOW_STEP_S)
        taken.append(True)
        return step()

    engine.step = step_slowly_once
    return engine


def test_a_request_due_during_a_step_counts_its_wait_for_that_step(tiny_llama_dir):
    """Requests 1 and 2 are due 50 ms in, while request 0's (slow) first step runs: the loop takes
    them only once it ends, but their TTFT counts from when they were due, as a serving engine's
    clients would see it (counted from when the loop took them, it would read a few ms)."""
    engine = slow_step(make_engine(tiny_llama_dir), 0)
    prompts = random_prompts(3, 8, 16, engine.limits.vocab_size, seed=1)
    workload = Workload(prompts, output_len=2, ignore_eos=True, arrivals_s=[0.0, 0.05, 0.05], concurrency=3)
    steps = []
    result = run_engine(engine, workload, on_step=lambda started, took, added, outputs: steps.append((took, added)))
    assert steps[0][0] >= SLOW_STEP_S and steps[0][1] == 1  # request 0 alone in the slow step
    assert result.ttft_ms["p50"] >= (SLOW_STEP_S - 0.05) * 1e3, result.ttft_ms


def test_a_request_held_back_by_the_concurrency_limit_counts_from_when_a_slot_freed(tiny_llama_dir):
    """One slot, two requests due at once: request 1 waits for request 0 to finish, as a client
    limited to one stream would, and its TTFT counts from the end of the (slow) step that finished
    request 0: not from the run's start, nor from that step's start."""
    engine = slow_step(make_engine(tiny_llama_dir), 1)  # request 0's second and last token
    prompts = random_prompts(2, 8, 16, engine.limits.vocab_size, seed=2)
    result = run_engine(engine, Workload(prompts, output_len=2, ignore_eos=True, arrivals_s=None, concurrency=1))
    assert result.e2e_ms["p99"] >= SLOW_STEP_S * 1e3  # request 0, through the slow step
    assert result.ttft_ms["p99"] < SLOW_STEP_S / 2 * 1e3, result.ttft_ms  # request 1 too: its own step only
