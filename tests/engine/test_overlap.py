"""Overlapped steps (step k + 1 queued before step k is read back) against steps run one by one:
the same tokens under a mixed load, aborts that never leak a token still in flight, and every KV
block back in the pool. Overlap is on by default only on CUDA; the bookkeeping is the same here."""
from dataclasses import replace

import pytest

from app.engine import SamplingParams
from tests.conftest import make_engine, mixed_sampling_params, random_prompts, run_staggered


def _engine(tiny_llama_dir, overlap: bool, **overrides):
    engine = make_engine(tiny_llama_dir, **overrides)
    engine.overlap = overlap
    return engine


def _completions(outputs) -> list:
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs] for out in outputs]


@pytest.mark.parametrize("pool_tokens, policy", [(4096, "GUARANTEED_NO_EVICT"), (512, "MAX_UTILIZATION")])
def test_overlapped_steps_give_the_same_outputs_as_serial_ones(tiny_llama_dir, pool_tokens, policy):
    """Staggered arrivals; the small pool preempts and recomputes under MAX_UTILIZATION."""
    prompts = random_prompts(24, 3, 60, vocab=256, seed=21)
    params = mixed_sampling_params(len(prompts))
    arrivals = [i // 3 for i in range(len(prompts))]
    runs = {}
    for overlap in (False, True):
        engine = _engine(tiny_llama_dir, overlap, max_tokens=pool_tokens, scheduler_policy=policy,
                         max_batch_size=16, max_num_tokens=96)
        runs[overlap] = run_staggered(engine, prompts, params, arrivals)
        stats = engine.stats()
        assert stats.used_blocks == 0 and not engine.has_unfinished_requests()
        if policy == "MAX_UTILIZATION":
            assert stats.num_preempted_total > 0
    assert _completions(runs[True]) == _completions(runs[False])
    for serial, overlapped in zip(runs[False], runs[True]):
        for a, b in zip(serial.outputs, overlapped.outputs):
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)


def test_top_logprobs_and_logit_bias_ride_overlapped_steps(tiny_llama_dir):
    """Requests asking for either stay overlappable; their tokens, logprobs and alternatives come
    back with their own step's tokens, as in steps run one by one."""
    prompts = random_prompts(12, 3, 40, vocab=256, seed=22)
    params = [replace(p, top_logprobs=1 + i % 4, logit_bias={3 + i: 4.0, 40: -100.0} if i % 3 else {})
              for i, p in enumerate(mixed_sampling_params(len(prompts)))]
    runs = {}
    for overlap in (False, True):
        engine = _engine(tiny_llama_dir, overlap, max_batch_size=8, max_num_tokens=64)
        runs[overlap] = run_staggered(engine, prompts, params, [i // 2 for i in range(len(prompts))])
        assert engine.stats().used_blocks == 0
    assert _completions(runs[True]) == _completions(runs[False])
    for p, serial, overlapped in zip(params, runs[False], runs[True]):
        for a, b in zip(serial.outputs, overlapped.outputs):
            assert [ids for ids, _ in b.top_logprobs] == [ids for ids, _ in a.top_logprobs]
            assert [v for _, values in b.top_logprobs for v in values] == \
                pytest.approx([v for _, values in a.top_logprobs for v in values], abs=1e-5)
            assert all(len(ids) == p.top_logprobs for ids, _ in b.top_logprobs)
            assert 40 not in b.token_ids or not p.logit_bias


def test_outputs_arrive_one_step_later_when_overlapped(tiny_llama_dir):
    prompt = random_prompts(1, 10, 10, vocab=256, seed=5)[0]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    deltas = {}
    for overlap in (False, True):
        engine = _engine(tiny_llama_dir, overlap)
        engine.add_request("r", prompt, params)
        deltas[overlap] = []
        while engine.has_unfinished_requests():
            deltas[overlap].append([t for out in engine.step() for t in out.outputs[0].token_ids])
    assert deltas[False] == [[t] for t in sum(deltas[False], [])]
    assert deltas[True] == [[]] + deltas[False]  # the first step's token is read back by the second


def test_abort_while_a_step_is_in_flight_leaks_no_token(tiny_llama_dir):
    prompt = random_prompts(1, 12, 12, vocab=256, seed=6)[0]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = _engine(tiny_llama_dir, False).generate([prompt], params)[0].outputs[0].token_ids
    engine = _engine(tiny_llama_dir, True)
    engine.add_request("a", prompt, params)
    engine.add_request("b", prompt, params)
    streamed = {"a": [], "b": []}
    for _ in range(6):
        for out in engine.step():
            streamed[out.request_id] += out.outputs[0].token_ids
    final = engine.abort_request("a")
    streamed["a"] += final.outputs[0].token_ids if final.outputs else []
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert len(streamed["a"]) >= 4 and streamed["a"] == full[:len(streamed["a"])]
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] += out.outputs[0].token_ids
    assert streamed["b"] == full
    assert engine.stats().used_blocks == 0
