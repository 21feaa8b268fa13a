"""Prompt logprobs (prompt_logprobs, what /v1/completions' echo with logprobs shows): each prompt
token's logprob given those before it, and the likeliest tokens there, equal to transformers'
log-softmax of the model's logits over the prompt, however the prompt is computed (in one step or
in chunks, after a cached prefix, overlapped, beside guessing decodes)."""
import functools

import pytest
import torch

from app.engine import InvalidRequestError, SamplingParams
from app.engine.outputs import merge_outputs
from app.engine import SchedulerPolicy
from tests.conftest import make_engine, random_prompts, run_staggered

PROMPT = random_prompts(1, 29, 29, vocab=256, seed=7)[0]  # 3 full blocks of 8 and a part
TOP = 3


def _reference(model, prompt: list[int]):
    """transformers' logprob of each prompt token after the first, and the TOP likeliest at each."""
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1).tolist()
    values, ids = logprobs.topk(TOP, dim=-1)
    return chosen, ids.tolist(), values.tolist()


@pytest.fixture(scope="module")
def reference(tiny_hf):
    return _reference(tiny_hf, PROMPT)


def _check(out, reference) -> None:
    chosen, ids, values = reference
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None  # nothing before it
    assert out.prompt_logprobs[1:] == pytest.approx(chosen, abs=1e-4)
    assert [top[0] for top in out.prompt_top_logprobs[1:]] == ids
    for top, expected in zip(out.prompt_top_logprobs[1:], values):
        assert top[1] == pytest.approx(expected, abs=1e-4)


PARAMS = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=TOP)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
@pytest.mark.parametrize("max_num_tokens", [64, 8, 5], ids=["one-step", "chunks-of-8", "chunks-of-5"])
def test_prompt_logprobs_match_transformers(tiny_llama_dir, reference, max_num_tokens, overlap):
    engine = make_engine(tiny_llama_dir, max_num_tokens=max_num_tokens)
    engine.overlap = overlap  # prompt rows are read back with their step; the decodes after them overlap
    plain = engine.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0))[0]
    out = engine.generate([PROMPT], PARAMS)[0]
    _check(out, reference)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert plain.prompt_logprobs is None


def test_a_cached_prefix_is_computed_again_for_them(tiny_llama_dir, reference):
    """The prompt's blocks are cached by an earlier request: one that asks for prompt logprobs
    computes them all the same (a cached block holds KV, not logits); one that does not reuses them."""
    engine = make_engine(tiny_llama_dir, max_num_tokens=8)
    engine.generate([PROMPT], SamplingParams(max_tokens=1))
    out = engine.generate([PROMPT], PARAMS)[0]
    _check(out, reference)
    assert out.metrics.kv_cache_reused_blocks == 0
    again = engine.generate([PROMPT], SamplingParams(max_tokens=1))[0]
    assert again.metrics.kv_cache_reused_blocks == 3


def test_preemption_recomputes_a_prompt_without_scoring_it_twice(tiny_llama_dir, tiny_hf):
    """A KV pool too small for the prompts at once (MAX_UTILIZATION preempts, chunks of 16): a
    sequence preempted mid-prompt recomputes it and scores only the rows it had not; all exact."""
    prompts = random_prompts(6, 20, 40, vocab=256, seed=2)
    engine = make_engine(tiny_llama_dir, max_tokens=160, scheduler_policy=SchedulerPolicy.MAX_UTILIZATION,
                         max_num_tokens=16)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    outputs = run_staggered(engine, prompts, params, [0, 0, 0, 1, 1, 2])
    assert engine.stats().num_preempted_total > 0
    for prompt, out in zip(prompts, outputs):
        _check(out, _reference(tiny_hf, prompt))


def test_they_come_once_with_the_first_output(tiny_llama_dir, reference):
    """With n outputs they come once (the outputs share the prompt), in the first streamed output,
    and merging streamed outputs keeps them; 0 alternatives gives the logprobs alone."""
    engine = make_engine(tiny_llama_dir, max_num_tokens=8)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=3, temperature=0.7, seed=1, n=2, prompt_logprobs=0))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert outputs[0].prompt_logprobs[1:] == pytest.approx(reference[0], abs=1e-4)
    assert outputs[0].prompt_top_logprobs is None
    assert all(o.prompt_logprobs is None for o in outputs[1:])
    merged = functools.reduce(merge_outputs, outputs, None)
    assert [len(c.token_ids) for c in merged.outputs] == [3, 3] and merged.prompt_logprobs == outputs[0].prompt_logprobs


def test_a_one_token_prompt_has_only_the_null(tiny_llama_dir):
    out = make_engine(tiny_llama_dir).generate([[5]], SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
    assert out.prompt_logprobs == [None] and out.prompt_top_logprobs == [None]


def test_beside_guessing_decodes(tiny_llama_dir, reference):
    """A prompt computed in the step where another sequence's decode carries guesses: both exact."""
    ngram = {"max_draft_len": 4, "max_matching_ngram_size": 2}
    repeating = [3, 4, 5, 6] * 6
    plain = make_engine(tiny_llama_dir).generate([repeating], SamplingParams(max_tokens=30, temperature=0.0))[0]
    engine = make_engine(tiny_llama_dir, speculative_config=ngram)
    outputs = engine.generate([repeating, PROMPT], [SamplingParams(max_tokens=30, temperature=0.0), PARAMS])
    assert outputs[0].outputs[0].token_ids == plain.outputs[0].token_ids
    _check(outputs[1], reference)


def test_beyond_max_logprobs_is_refused_by_name(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_logprobs=4)
    with pytest.raises(InvalidRequestError, match="max_logprobs") as err:
        engine.add_request("r", PROMPT, SamplingParams(prompt_logprobs=5))
    assert err.value.field == "prompt_logprobs"
