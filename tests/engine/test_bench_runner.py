"""The engine benchmark's driver (tools/bench/engine_runner.py): when a request's TTFT starts."""
import statistics
import time
from dataclasses import replace

from app.engine import EngineConfig
from app.engine.engine_process import EngineProcess
from tests.conftest import make_engine, random_prompts
from tools.bench.engine_runner import run_engine
from tools.bench.process_runner import run_engine_process
from tools.bench.workload import Workload, synthetic

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


def test_a_round_trip_holds_a_freed_slot_back_and_counts_from_its_return(tiny_llama_dir):
    """One slot, a 0.3 s round trip: request 1 reaches the engine only once request 0's last token
    has gone out and request 1 has come back, and its TTFT counts from then, as the serving path's
    client would see it: short, not the round trip plus its own step."""
    engine = make_engine(tiny_llama_dir)
    prompts = random_prompts(2, 8, 16, engine.limits.vocab_size, seed=3)
    steps = []
    workload = Workload(prompts, output_len=2, ignore_eos=True, arrivals_s=None, concurrency=1, round_trip_s=0.3)
    result = run_engine(engine, workload, on_step=lambda started, took, added, outputs: steps.append(
        (started, took, added, [o.finished for o in outputs])))
    last_of_0 = next(started + took for started, took, _, finished in steps if any(finished))
    first_with_1 = next(started for started, _, added, _ in steps if added == 2)
    assert first_with_1 - last_of_0 >= 0.3, steps
    assert result.ttft_ms["p99"] < 240, result.ttft_ms  # their own steps only, not the 300 ms round trip


def test_output_lengths_drawn_from_a_range_are_what_each_request_generates(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    workload = synthetic(6, "8:16", "2:9", engine.limits.vocab_size, seed=4, concurrency=6)
    assert workload.output_len == 9 and len(set(workload.output_lens)) > 1
    assert all(2 <= n <= 9 for n in workload.output_lens)
    result = run_engine(engine, workload)
    assert result.output_lens == workload.output_lens


def test_the_engine_process_runner_streams_each_request_its_own_length_and_waits_out_the_round_trip(tiny_llama_dir):
    """Through the engine's own process (as a GPU Engine replica runs it): every request generates
    the length drawn for it, and with one client the second request starts only once the first has
    come back (0.3 s after its end), its TTFT counted from then. The engine's steps are counted: one
    request at a time makes a token a step."""
    engine = EngineProcess(EngineConfig(model=str(tiny_llama_dir),
                                        kv_cache_config={"max_tokens": 4096, "tokens_per_block": 8}), cpu_threads=1)
    try:
        workload = replace(synthetic(3, "8:16", "2:9", 256, seed=5, concurrency=1), round_trip_s=0.3)
        result = run_engine_process(engine, workload, "process")
    finally:
        engine.shutdown()
    assert result.output_lens == workload.output_lens
    assert result.wall_s >= 0.6 and result.ttft_ms["p99"] < 240, (result.wall_s, result.ttft_ms)
    assert sum(workload.output_lens) <= result.extra["steps"] <= sum(workload.output_lens) + 3, result.extra


def test_the_scheduler_cost_loop_serves_every_request_at_full_concurrency():
    """tools/bench/scheduler_cost.py's closed loop: every one of 12 requests (2-5 output tokens) over 4
    streams comes in as another ends and finishes, in at least the steps their tokens need at 4 a step;
    replaced 3 steps later, it takes more steps. A step's tokens are counted: the first holds every prompt."""
    from tools.bench.scheduler_cost import run
    at_once = run(streams=4, requests=12, prompt_len=8, output_lens=(2, 5), seed=1)
    later = run(streams=4, requests=12, prompt_len=8, output_lens=(2, 5), seed=1, replace_after=3)
    assert at_once.finished == later.finished == 12
    assert 12 * 2 // 4 <= len(at_once.step_tokens) < len(later.step_tokens) <= 12 * 5 + 3 * 12
    assert at_once.step_tokens[0] == 4 * 8 and at_once.share_over(8) > 0 and at_once.schedule_ms > 0


def test_the_closed_loop_model_times_steps_as_the_overlap_scheduler_plans_them():
    """tools/bench/closed_loop.py, every step 10 ms. One stream, requests of 3 tokens: the first token
    when the prompt's step ends, one a step after; the replacement arrives a round trip (5 ms) after
    the last step ends, to an idle device. Two streams (seed 6: 8 and 2 tokens): the short request's
    replacement arrives 3 ms into step 3, so the step planned as step 3 starts (step 4) misses it and
    it waits for step 5 (TTFT 27 ms); planned 5 ms before step 3 ends (late planning), step 4 takes it."""
    from tools.bench.closed_loop import StepModel, run
    steps_10ms = StepModel(10.0, 0.0, 0.0)
    one = run(streams=1, requests=2, prompt_len=8, output_lens=(3, 3), round_trip_ms=5.0, step_model=steps_10ms)
    assert one.ttft_ms == [10.0, 10.0] and one.tpot_ms == [10.0, 10.0]
    assert (one.wall_ms, one.output_tokens, one.steps) == (30 + 5 + 30, 6, 6)
    two = dict(streams=2, requests=3, prompt_len=8, output_lens=(2, 8), round_trip_ms=3.0, step_model=steps_10ms, seed=6)
    at_start, late = run(**two), run(**two, plan_lead_ms=5.0)
    assert at_start.ttft_ms == [10.0, 10.0, 27.0] and late.ttft_ms == [10.0, 10.0, 17.0]


def test_the_closed_loop_model_queues_a_round_trip_of_arrivals_at_every_refill():
    """256 streams of 128/128 on the H200 model: a 40 ms round trip costs the TTFT p50 more than
    three round trips (the replacements come back as a bunch and queue behind each refill), while
    tok/s stays within 3%. With outputs of 64-192 tokens the generations mix: it costs less than one."""
    from tools.bench.closed_loop import run
    loop = dict(streams=256, requests=512, prompt_len=128)
    same = [run(**loop, output_lens=(128, 128), round_trip_ms=rt) for rt in (0.0, 40.0)]
    mixed = [run(**loop, output_lens=(64, 192), round_trip_ms=rt) for rt in (0.0, 40.0)]
    p50 = [[statistics.median(r.ttft_ms) for r in pair] for pair in (same, mixed)]
    assert p50[0][1] - p50[0][0] > 3 * 40.0 and p50[1][1] - p50[1][0] < 40.0
    assert same[1].tok_s > 0.97 * same[0].tok_s
