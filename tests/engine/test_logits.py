"""Raw logits returned with a request (return_context_logits, return_generation_logits, TensorRT-LLM's
names): every prompt position's row and each output token's row, equal to transformers' logits in
fp32, however the prompt is computed (one step, chunks, after a cached prefix, preempted) and
whatever the sampler then did with them."""
import functools
import pickle

import numpy as np
import pytest
import torch

from app.engine import InvalidRequestError, SamplingParams, SchedulerPolicy
from app.engine.outputs import merge_outputs
from tests.conftest import make_engine, random_prompts, run_staggered

PROMPT = random_prompts(1, 29, 29, vocab=256, seed=7)[0]  # 3 full blocks of 8 and a part
VOCAB = 256
BOTH = dict(return_context_logits=True, return_generation_logits=True)


def _forward(model, tokens: list[int]) -> np.ndarray:
    """transformers' fp32 logits at every position of `tokens`."""
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def _check(out, model, prompt: list[int]) -> None:
    """Context rows are the prompt's positions; output i's rows are the positions its tokens were
    drawn at (the prompt's last, then each output token's before it)."""
    assert out.context_logits.dtype == np.float32 and out.context_logits.shape == (len(prompt), VOCAB)
    for c in out.outputs:
        expected = _forward(model, prompt + c.token_ids)
        np.testing.assert_allclose(out.context_logits, expected[:len(prompt)], atol=1e-4, rtol=0)
        rows = c.generation_logits
        assert rows.dtype == np.float32 and rows.shape == (len(c.token_ids), VOCAB)
        np.testing.assert_allclose(rows, expected[len(prompt) - 1:-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap-on"])
@pytest.mark.parametrize("max_num_tokens", [64, 8, 5], ids=["one-step", "chunks-of-8", "chunks-of-5"])
def test_they_match_transformers(tiny_llama_dir, tiny_hf, max_num_tokens, overlap):
    """Any chunking; with the overlap scheduler on, requests asking for logits step without it
    and the others around them still overlap."""
    engine = make_engine(tiny_llama_dir, max_num_tokens=max_num_tokens)
    engine.overlap = overlap
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = engine.generate([PROMPT, PROMPT[:11]], [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                                  **BOTH), plain])
    _check(outs[0], tiny_hf, PROMPT)
    assert outs[1].context_logits is None and outs[1].outputs[0].generation_logits is None
    assert outs[0].outputs[0].token_ids == engine.generate([PROMPT], plain)[0].outputs[0].token_ids


def test_generation_logits_are_transformers_per_step_logits_greedy(tiny_llama_dir, tiny_hf):
    """transformers' generate(output_logits=True): its raw scores of each greedy step, and its tokens."""
    out = make_engine(tiny_llama_dir).generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, return_generation_logits=True))[0]
    with torch.inference_mode():
        ref = tiny_hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                               output_logits=True, return_dict_in_generate=True, pad_token_id=1)
    assert out.outputs[0].token_ids == ref.sequences[0, len(PROMPT):].tolist()
    np.testing.assert_allclose(out.outputs[0].generation_logits, torch.cat(ref.logits).float().numpy(),
                               atol=1e-4, rtol=0)
    assert out.context_logits is None


def test_they_are_raw_whatever_the_sampler_did(tiny_llama_dir, tiny_hf):
    """Penalties, bias, bans and temperature change the draw, never the rows (as logprobs)."""
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, repetition_penalty=1.3, logit_bias={5: 20.0},
                            bad_token_ids=[[7]], **BOTH)
    _check(make_engine(tiny_llama_dir).generate([PROMPT], params)[0], tiny_hf, PROMPT)


def test_a_cached_prefix_is_computed_again_for_them(tiny_llama_dir, tiny_hf):
    engine = make_engine(tiny_llama_dir, max_num_tokens=8)
    engine.generate([PROMPT], SamplingParams(max_tokens=1))
    out = engine.generate([PROMPT], SamplingParams(max_tokens=3, return_context_logits=True))[0]
    assert out.metrics.kv_cache_reused_blocks == 0
    assert out.context_logits.shape == (len(PROMPT), VOCAB)
    np.testing.assert_allclose(out.context_logits, _forward(tiny_hf, PROMPT), atol=1e-4, rtol=0)
    gen = engine.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0, return_generation_logits=True))[0]
    assert gen.metrics.kv_cache_reused_blocks == 3  # generation rows alone come from the steps that sample


def test_preempted_requests_take_each_row_once(tiny_llama_dir, tiny_hf):
    """A KV pool too small for the prompts at once (MAX_UTILIZATION preempts, chunks of 16): a
    sequence preempted mid-prompt or mid-answer recomputes and takes no row twice; all exact."""
    prompts = random_prompts(6, 20, 40, vocab=256, seed=2)
    engine = make_engine(tiny_llama_dir, max_tokens=160, scheduler_policy=SchedulerPolicy.MAX_UTILIZATION,
                         max_num_tokens=16)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **BOTH)
    outputs = run_staggered(engine, prompts, params, [0, 0, 0, 1, 1, 2])
    assert engine.stats().num_preempted_total > 0
    for prompt, out in zip(prompts, outputs):
        _check(out, tiny_hf, prompt)


def test_streamed_rows_go_with_their_tokens(tiny_llama_dir, tiny_hf):
    """Each delta carries the rows of its own tokens (a stop sequence's held-back tokens hold
    theirs back too, and a cut stop sequence takes its rows with it); the context comes once, with
    the first output, and n outputs each have their own rows."""
    engine = make_engine(tiny_llama_dir)
    greedy = make_engine(tiny_llama_dir).generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0,
                                                                           ignore_eos=True))[0].outputs[0].token_ids
    stop = greedy[6:8]
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=12, temperature=0.7, seed=5, n=2, ignore_eos=True,
                                                   stop_token_ids=[stop], **BOTH))
    deltas = []
    while engine.has_unfinished_requests():
        deltas.extend(engine.step())
    assert deltas[0].context_logits is not None and all(d.context_logits is None for d in deltas[1:])
    for d in deltas:
        for c in d.outputs:
            assert (c.generation_logits is None and not c.token_ids) or len(c.generation_logits) == len(c.token_ids)
    merged = functools.reduce(merge_outputs, deltas, None)
    assert len(merged.outputs) == 2
    _check(merged, tiny_hf, PROMPT)


def test_guessing_decodes_take_a_row_per_token(tiny_llama_dir, tiny_hf):
    """Speculation (a proposer that knows the answer and spoils its last guess): a step's rows
    check guesses; each token taken brings its own row, none from a rejected guess."""
    from tests.engine.test_speculative import spoiled_answers

    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, **BOTH)
    plain = make_engine(tiny_llama_dir).generate([PROMPT], params)
    engine = make_engine(tiny_llama_dir, speculative_config={"max_draft_len": 4, "max_matching_ngram_size": 2})
    engine.proposer.propose = spoiled_answers([PROMPT], plain)
    out = engine.generate([PROMPT], params)[0]
    assert 0 < out.metrics.total_accepted_draft_tokens < out.metrics.total_draft_tokens
    assert out.outputs[0].token_ids == plain[0].outputs[0].token_ids
    _check(out, tiny_hf, PROMPT)


def test_a_one_token_prompt_has_one_context_row(tiny_llama_dir, tiny_hf):
    out = make_engine(tiny_llama_dir).generate([[5]], SamplingParams(max_tokens=2, **BOTH))[0]
    _check(out, tiny_hf, [5])


def test_beams_return_context_logits_only(tiny_llama_dir, tiny_hf):
    engine = make_engine(tiny_llama_dir)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=4, beam_width=2, return_context_logits=True))[0]
    np.testing.assert_allclose(out.context_logits, _forward(tiny_hf, PROMPT), atol=1e-4, rtol=0)
    with pytest.raises(InvalidRequestError, match="beam search") as err:
        engine.add_request("b", PROMPT, SamplingParams(max_tokens=4, beam_width=2, return_generation_logits=True))
    assert err.value.field == "return_generation_logits"


def test_over_the_limit_is_refused_by_name(tiny_llama_dir):
    """max_logits_floats bounds prompt x vocab (context) plus max_tokens x n x vocab (generation)."""
    engine = make_engine(tiny_llama_dir, max_logits_floats=10 * VOCAB)
    with pytest.raises(InvalidRequestError, match=rf"max_logits_floats \({10 * VOCAB}\).*at most 10 tokens") as err:
        engine.add_request("c", [5] * 11, SamplingParams(max_tokens=1, return_context_logits=True))
    assert err.value.field == "return_context_logits"
    with pytest.raises(InvalidRequestError, match="max_tokens of at most 2 here") as err:
        engine.add_request("g", [5] * 6, SamplingParams(max_tokens=3, n=2, **BOTH))
    assert err.value.field == "return_generation_logits"
    engine.add_request("ok", [5] * 6, SamplingParams(max_tokens=2, n=2, **BOTH))  # 6 + 2 x 2 rows: at the limit
    with pytest.raises(InvalidRequestError) as err:  # no max_tokens: up to the context's end, far past it
        engine.add_request("d", [5] * 6, SamplingParams(max_tokens=None, return_generation_logits=True))
    assert err.value.field == "return_generation_logits"


def test_rows_travel_as_raw_float32_bytes(tiny_llama_dir):
    """What crosses the DAG's data connections is pickled: the rows cost their bytes, not a float
    object each."""
    out = make_engine(tiny_llama_dir).generate([PROMPT], SamplingParams(max_tokens=4, **BOTH))[0]
    raw = out.context_logits.nbytes + out.outputs[0].generation_logits.nbytes
    assert raw == (len(PROMPT) + 4) * VOCAB * 4
    assert len(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)) < raw + 2048
