"""Greedy outputs and logprobs equal transformers' own generate, under every scheduling regime."""
import pytest

from app.engine import SamplingParams, SchedulerPolicy
from tests.conftest import hf_greedy, hf_greedy_logprobs, make_engine, random_prompts, run_staggered

GREEDY = SamplingParams(max_tokens=20, temperature=0.0)


def _tiny_prompts():
    prompts = random_prompts(6, 3, 40, vocab=256, seed=1)
    prompts.append(prompts[0][:24] + [7, 8, 9])  # shares three full blocks with prompt 0
    return prompts


@pytest.fixture(scope="module")
def tiny_expected(tiny_hf):
    return [hf_greedy(tiny_hf, p, GREEDY.max_tokens) for p in _tiny_prompts()]


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no-reuse"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prefill"])
def test_tiny_greedy_matches_transformers(tiny_llama_dir, tiny_expected, reuse, chunked):
    engine = make_engine(tiny_llama_dir, reuse=reuse, enable_chunked_prefill=chunked,
                         max_num_tokens=16 if chunked else 64)
    prompts = _tiny_prompts()
    arrivals = [0, 0, 1, 3, 3, 7, 12]
    for _ in range(2):  # the second pass finds the first pass's blocks in the cache
        outputs = run_staggered(engine, prompts, GREEDY, arrivals)
        assert [o.outputs[0].token_ids for o in outputs] == tiny_expected
    stats = engine.stats()
    assert (stats.reused_blocks_total > 0) == reuse
    assert stats.free_blocks == stats.max_blocks  # every block came back


def test_preemption_keeps_outputs(tiny_llama_dir, tiny_expected):
    engine = make_engine(tiny_llama_dir, max_tokens=96, scheduler_policy=SchedulerPolicy.MAX_UTILIZATION,
                         max_num_tokens=32)
    outputs = run_staggered(engine, _tiny_prompts(), GREEDY, [0] * 7)
    assert engine.stats().num_preempted_total > 0
    assert [o.outputs[0].token_ids for o in outputs] == tiny_expected
    assert any(o.metrics.num_preemptions for o in outputs)


# A KV pool too small for the prompts at once: MAX_UTILIZATION preempts and resumes.
SMALL_POOL = dict(max_tokens=160, scheduler_policy=SchedulerPolicy.MAX_UTILIZATION, max_num_tokens=16)


def check_preempting_reuse(engine, expected) -> None:
    """Staggered arrivals, twice (the second pass finds the first's blocks cached): outputs exact,
    preemptions and reuse both happened, every block came back."""
    for _ in range(2):
        outputs = run_staggered(engine, _tiny_prompts(), GREEDY, [0, 0, 1, 3, 3, 7, 12])
        assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = engine.stats()
    assert stats.num_preempted_total > 0 and stats.reused_blocks_total > 0
    assert stats.free_blocks == stats.max_blocks


def test_preemption_with_block_reuse_keeps_outputs(tiny_llama_dir, tiny_expected):
    """Cached prefixes sit in the free list: admitting a sequence revives its cached blocks and
    needs room for its first chunk after them (this once overdrew the pool)."""
    check_preempting_reuse(make_engine(tiny_llama_dir, **SMALL_POOL), tiny_expected)


def test_guaranteed_no_evict_never_preempts(tiny_llama_dir, tiny_expected):
    engine = make_engine(tiny_llama_dir, max_tokens=96, max_num_tokens=32)
    outputs = run_staggered(engine, _tiny_prompts(), GREEDY, [0] * 7)
    assert engine.stats().num_preempted_total == 0
    assert [o.outputs[0].token_ids for o in outputs] == tiny_expected


def test_static_batching_matches(tiny_llama_dir, tiny_expected):
    engine = make_engine(tiny_llama_dir, batching_type="STATIC", max_batch_size=3)
    outputs = run_staggered(engine, _tiny_prompts(), GREEDY, [0, 0, 1, 3, 3, 7, 12])
    assert [o.outputs[0].token_ids for o in outputs] == tiny_expected


def test_logprobs_match_transformers(tiny_llama_dir, tiny_hf):
    prompt = random_prompts(1, 12, 12, vocab=256, seed=5)[0]
    engine = make_engine(tiny_llama_dir)
    out = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, logprobs=True))[0].outputs[0]
    tokens, ref_logprobs = hf_greedy_logprobs(tiny_hf, prompt, 10, pad_token_id=1)
    n = len(out.token_ids)
    assert out.token_ids == tokens[:n]
    assert out.logprobs == pytest.approx(ref_logprobs[:n], abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(ref_logprobs[:n]), abs=1e-3)


def test_smollm2_greedy_matches_transformers(smollm2_dir, smollm2_hf, smollm2_tokenizer):
    questions = ["What is the capital of France?", "Name three primary colors.",
                 "Write a haiku about the sea.", "What is 12 times 12?"]
    prompts = [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)["input_ids"] for q in questions]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=True)
    expected = [hf_greedy(smollm2_hf, p, 24) for p in prompts]
    engine = make_engine(smollm2_dir, tokens_per_block=16, max_num_tokens=32)
    outputs = run_staggered(engine, prompts, params, [0, 0, 2, 5])
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert smollm2_tokenizer.decode(outputs[0].outputs[0].token_ids) == "The capital of France is Paris."
    assert outputs[0].outputs[0].finish_reason == "stop"
    assert engine.stats().reused_blocks_total > 0  # the shared system prompt's blocks
