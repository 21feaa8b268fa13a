"""Engine behaviour request by request: stops, limits, sampling, top logprobs and logit bias, beams,
abort, reuse, metrics."""
import pytest
import torch

from app.engine import InvalidRequestError, SamplingParams
from app.engine.outputs import merge_outputs
from tests.conftest import hf_greedy, make_engine, random_prompts

PROMPT = random_prompts(1, 20, 20, vocab=256, seed=3)[0]


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "overlapped"])
def engine(tiny_llama_dir, request):
    """Every behaviour with steps run one by one, and overlapped: step k + 1 queued before step k
    is read back. Overlap is a CUDA default; on CPU it changes nothing but the bookkeeping checked here."""
    engine = make_engine(tiny_llama_dir)
    engine.overlap = request.param
    return engine


@pytest.fixture(scope="module")
def greedy_tokens(engine):
    return engine.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids


def _generate(engine, **params):
    return engine.generate([PROMPT], SamplingParams(**params))[0]


def test_stop_sequence_cuts_exactly(engine, greedy_tokens):
    stop = greedy_tokens[5:8]
    out = _generate(engine, max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[[255, 254], stop])
    first = next(i for i in range(len(greedy_tokens)) if greedy_tokens[i:i + 3] == stop)
    assert out.outputs[0].token_ids == greedy_tokens[:first]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_end_id_stops_and_min_tokens_holds(engine, greedy_tokens):
    end = greedy_tokens[3]
    first = greedy_tokens.index(end)
    out = _generate(engine, max_tokens=24, temperature=0.0, end_id=end)
    assert out.outputs[0].token_ids == greedy_tokens[:first]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == end
    held = _generate(engine, max_tokens=24, temperature=0.0, end_id=end, min_tokens=first + 4).outputs[0]
    assert len(held.token_ids) >= first + 4
    assert end not in held.token_ids[:first + 4]


def test_max_tokens_and_ignore_eos(engine):
    out = _generate(engine, max_tokens=7, temperature=0.0, ignore_eos=True).outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_no_max_tokens_runs_to_the_end_of_the_context(tiny_llama_dir):
    """max_tokens None (OpenAI's default): as many tokens as the context holds after the prompt,
    within max_output_len; a prompt that fills the context leaves none and is refused."""
    from app.engine.sampling_params import validate_request

    engine = make_engine(tiny_llama_dir, max_seq_len=48)
    prompt = random_prompts(1, 20, 20, vocab=256, seed=3)[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=None, ignore_eos=True, temperature=0.0))[0]
    assert len(out.outputs[0].token_ids) == 48 - 20 and out.outputs[0].finish_reason == "length"
    capped = make_engine(tiny_llama_dir, max_seq_len=48, max_output_len=5).limits
    assert validate_request(prompt, SamplingParams(max_tokens=None), capped).max_tokens == 5
    small_cache = make_engine(tiny_llama_dir, max_tokens=16, max_seq_len=48).limits
    with pytest.raises(InvalidRequestError, match="no room for output"):
        validate_request(prompt, SamplingParams(max_tokens=None), small_cache)


def test_bad_words_are_never_produced(engine, greedy_tokens):
    banned = greedy_tokens[2]
    out = _generate(engine, max_tokens=24, temperature=0.0, ignore_eos=True, bad_token_ids=[[banned]]).outputs[0]
    assert banned not in out.token_ids
    assert out.token_ids[:2] == greedy_tokens[:2]
    # A two-token bad word bans its last token only right after its first.
    pair = greedy_tokens[4:6]
    out = _generate(engine, max_tokens=24, temperature=0.0, ignore_eos=True, bad_token_ids=[pair]).outputs[0]
    assert out.token_ids[:5] == greedy_tokens[:5] and out.token_ids[5] != pair[1]


def test_repetition_penalty_matches_transformers(engine, tiny_hf):
    out = _generate(engine, max_tokens=16, temperature=0.0, repetition_penalty=1.8).outputs[0]
    assert out.token_ids == hf_greedy(tiny_hf, PROMPT, 16, repetition_penalty=1.8)[:len(out.token_ids)]


def _reference_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each position that produced one of `tokens` (teacher forcing)."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


def _check_top_logprobs(model, output, k: int) -> None:
    """Each token's logprob and its k likeliest alternatives are the raw model's, best first."""
    ref = _reference_logprobs(model, PROMPT, output.token_ids)
    values, ids = ref.topk(k, dim=-1)
    assert len(output.top_logprobs) == len(output.token_ids) > 0
    for pos, (token, logprob, (top_ids, top_values)) in enumerate(zip(output.token_ids, output.logprobs,
                                                                       output.top_logprobs)):
        assert top_ids == ids[pos].tolist() and top_values == pytest.approx(values[pos].tolist(), abs=1e-4)
        assert logprob == pytest.approx(ref[pos, token].item(), abs=1e-4)
        if token in top_ids:
            assert top_values[top_ids.index(token)] == pytest.approx(logprob, abs=1e-6)


def test_top_logprobs_match_transformers(engine, tiny_hf, greedy_tokens):
    out = _generate(engine, max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5).outputs[0]
    assert out.token_ids == greedy_tokens[:12]
    _check_top_logprobs(tiny_hf, out, 5)
    assert [top_ids[0] for top_ids, _ in out.top_logprobs] == out.token_ids  # greedy: the likeliest is the one taken
    # n > 1 and sampling: each sample's own alternatives, raw (before temperature and top-k).
    out = _generate(engine, max_tokens=8, temperature=1.3, top_k=20, seed=3, n=2, ignore_eos=True, logprobs=True,
                    top_logprobs=2)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    for output in out.outputs:
        _check_top_logprobs(tiny_hf, output, 2)
    # Requests that do not ask get none, in the same batch.
    greedy = dict(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
    plain, asking = engine.generate([PROMPT] * 2, [SamplingParams(**greedy), SamplingParams(**greedy, top_logprobs=1)])
    assert plain.outputs[0].top_logprobs is None and len(asking.outputs[0].top_logprobs) == 4


def test_logit_bias_forces_and_bans_tokens(engine, tiny_hf, greedy_tokens):
    forced = 77
    out = _generate(engine, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True,
                    logit_bias={forced: 100.0}).outputs[0]
    assert out.token_ids == [forced] * 6
    # The logprobs stay the model's own: the bias moved the choice, not the distribution reported.
    ref = _reference_logprobs(tiny_hf, PROMPT, out.token_ids)
    assert out.logprobs == pytest.approx(ref[:, forced].tolist(), abs=1e-4)
    banned = greedy_tokens[0]
    out = _generate(engine, max_tokens=16, temperature=0.0, logit_bias={banned: -100.0}).outputs[0]
    assert banned not in out.token_ids
    assert out.token_ids == hf_greedy(tiny_hf, PROMPT, 16, sequence_bias={(banned,): -100.0})[:len(out.token_ids)]
    # n > 1 sampled, beside a request without a bias in the same batch: each row gets its own.
    biased, plain = engine.generate(
        [PROMPT, PROMPT], [SamplingParams(max_tokens=5, temperature=1.0, seed=2, n=2, ignore_eos=True,
                                          logit_bias={forced: 100.0, banned: -100.0}),
                           SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)])
    assert [o.token_ids for o in biased.outputs] == [[forced] * 5] * 2
    assert plain.outputs[0].token_ids == greedy_tokens


def test_seeded_sampling_is_reproducible(engine):
    params = dict(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    a = _generate(engine, **params).outputs[0].token_ids
    b = _generate(engine, **params).outputs[0].token_ids
    c = _generate(engine, **{**params, "seed": 99}).outputs[0].token_ids
    assert a == b and a != c
    # Seeded results do not depend on what else shares the batch.
    mixed = engine.generate([PROMPT, PROMPT[:10]], [SamplingParams(**params), SamplingParams(**{**params, "seed": 7})])
    assert mixed[0].outputs[0].token_ids == a


def test_n_returns_independent_samples(engine):
    out = _generate(engine, max_tokens=12, temperature=1.0, seed=5, n=3, ignore_eos=True)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_top_k_one_is_greedy(engine, greedy_tokens):
    out = _generate(engine, max_tokens=24, temperature=0.7, top_k=1, ignore_eos=True).outputs[0]
    assert out.token_ids == greedy_tokens


def _hf_beams(model, prompt, width, max_new_tokens, extra_eos=()):
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) | set(extra_eos)
    with torch.inference_mode():
        seqs = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                              max_new_tokens=max_new_tokens, pad_token_id=-1, eos_token_id=sorted(eos))
    beams = []
    for row in seqs[:, len(prompt):].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos or t == -1), len(row))
        beams.append(row[:cut])
    return beams


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_transformers(engine, tiny_hf, width):
    out = _generate(engine, max_tokens=12, beam_width=width, n=width)
    assert [c.token_ids for c in out.outputs] == _hf_beams(tiny_hf, PROMPT, width, 12)
    assert engine.stats().free_blocks == engine.stats().max_blocks


def test_beam_search_ends_a_beam_on_a_stop_token_as_on_the_end_id(engine, tiny_hf):
    """stop_token_ids end a beam (they were ignored: every beam ran to max_tokens); a one-token
    stop acts as one more end id, which is transformers' reference."""
    plain = _generate(engine, max_tokens=12, beam_width=2, n=2).outputs
    stop = plain[0].token_ids[3]
    out = _generate(engine, max_tokens=12, beam_width=2, n=2, stop_token_ids=[[stop]]).outputs
    assert [c.token_ids for c in out] == _hf_beams(tiny_hf, PROMPT, 2, 12, extra_eos=[stop])
    assert not any(stop in c.token_ids for c in out)


def test_beam_search_with_end_of_sequence(smollm2_dir, smollm2_hf, smollm2_tokenizer):
    prompt = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    engine = make_engine(smollm2_dir, tokens_per_block=16)
    out = engine.generate([prompt], SamplingParams(max_tokens=16, beam_width=3, n=3))[0]
    assert [c.token_ids for c in out.outputs] == _hf_beams(smollm2_hf, prompt, 3, 16)
    assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("policy, plain_len", [("GUARANTEED_NO_EVICT", 40), ("MAX_UTILIZATION", 56)])
def test_beams_fork_in_a_full_pool_beside_other_requests(tiny_llama_dir, policy, plain_len):
    """A pool of 8 blocks that a plain request fills beside the beams' 2: a beam forks only once the beams it
    dropped gave their blocks back (a fork first, with every free block taken, failed the step and
    every request in it; three in a row killed the engine), and under MAX_UTILIZATION a fork
    preempts as growth does. The beams are those of an engine with room to spare."""
    beam = SamplingParams(max_tokens=4, beam_width=2, n=2, temperature=0.0)
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    roomy = make_engine(tiny_llama_dir)
    want = {"beam": roomy.generate([[5, 6, 7, 8]], beam)[0],
            "plain": roomy.generate([list(range(2, 2 + plain_len))], plain)[0]}
    engine = make_engine(tiny_llama_dir, max_tokens=64, tokens_per_block=8, scheduler_policy=policy)
    for round_ in range(3):
        engine.add_request("beam", [5, 6, 7, 8], beam)
        engine.add_request("plain", list(range(2, 2 + plain_len)), plain)
        got = {}
        for _ in range(200):  # a bound, not a hang, where a request is never admitted
            for out in engine.step():
                assert out.error is None
                got[out.request_id] = merge_outputs(got.get(out.request_id), out)
        assert not engine.has_unfinished_requests()
        for rid, reference in want.items():
            assert [c.token_ids for c in got[rid].outputs] == [c.token_ids for c in reference.outputs], (round_, rid)
        assert engine.stats().used_blocks == 0


def test_a_preempted_sequence_longer_than_a_step_resumes_with_chunked_prefill_off(tiny_llama_dir):
    """Preempted at 89 tokens, B needs more than max_num_tokens (64) to recompute: with whole prompts
    only, it waited at the head of the queue forever, and every request behind it. It recomputes in
    chunks, and both answers are those of an engine with room to spare."""
    prompts = [list(range(2, 42)), list(range(2, 58))]
    params = [SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)]
    want = make_engine(tiny_llama_dir).generate(prompts, params)
    engine = make_engine(tiny_llama_dir, max_tokens=128, tokens_per_block=8, scheduler_policy="MAX_UTILIZATION",
                         enable_chunked_prefill=False, max_num_tokens=64)
    got = {}
    for rid, prompt, p in zip("AB", prompts, params):
        engine.add_request(rid, prompt, p)
    for _ in range(1000):  # a bound, not a hang, where the sequence never resumes
        for out in engine.step():
            got[out.request_id] = merge_outputs(got.get(out.request_id), out)
    assert engine.stats().num_preempted_total >= 1 and not engine.has_unfinished_requests()
    assert [got[rid].outputs[0].token_ids for rid in "AB"] == [o.outputs[0].token_ids for o in want]


def test_what_a_config_could_never_run_is_refused(tiny_llama_dir):
    """A search wider than the batch would never be admitted (and would hold up the queue behind
    it); more top logprobs than the vocabulary made topk fail the step."""
    engine = make_engine(tiny_llama_dir, max_batch_size=2, max_logprobs=1000)
    with pytest.raises(InvalidRequestError, match=r"beam_width: must be in \[1, 2\]"):
        engine.add_request("wide", [5, 6], SamplingParams(beam_width=3))
    with pytest.raises(InvalidRequestError, match="top_logprobs: 257 exceeds"):
        engine.add_request("many", [5, 6], SamplingParams(top_logprobs=257))
    out = engine.generate([[5, 6]], SamplingParams(max_tokens=2, top_logprobs=256, beam_width=1))[0]
    assert len(out.outputs[0].top_logprobs[0][0]) == 256


def test_beams_that_cannot_all_fit_the_pool_are_refused(tiny_llama_dir):
    """Each beam holds its own blocks: a search whose beams could never fit together waited at the
    head of the queue forever, and every request behind it with it. Without max_tokens, the
    default is what the pool holds per beam."""
    engine = make_engine(tiny_llama_dir, max_tokens=64, tokens_per_block=8)
    with pytest.raises(InvalidRequestError, match="max_tokens: .*exceeds the KV cache of 32 tokens per beam"):
        engine.add_request("wide", [5, 6, 7, 8], SamplingParams(max_tokens=40, beam_width=2))
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=None, beam_width=2, n=2, ignore_eos=True))[0]
    assert [len(c.token_ids) for c in out.outputs] == [28, 28]
    assert engine.generate([[5, 6]], SamplingParams(max_tokens=4, temperature=0.0))[0].finished


def test_abort_frees_blocks_at_once(engine):
    engine.add_request("long", PROMPT, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.stats().used_blocks > 0
    final = engine.abort_request("long")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    stats = engine.stats()
    assert stats.used_blocks == 0 and stats.num_running == 0
    assert not engine.has_unfinished_requests()


def test_block_reuse_on_shared_prefix(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, tokens_per_block=8)
    prefix = random_prompts(1, 32, 32, vocab=256, seed=11)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = engine.generate([prefix + [5, 6]], params)[0]
    second = engine.generate([prefix + [9, 10, 11]], params)[0]
    assert first.metrics.kv_cache_reused_blocks == 0
    assert second.metrics.kv_cache_reused_blocks == 4
    assert second.metrics.kv_cache_hit_rate == pytest.approx(4 / second.metrics.kv_cache_alloc_total_blocks)
    cold = make_engine(tiny_llama_dir, reuse=False).generate([prefix + [9, 10, 11]], params)[0]
    assert second.outputs[0].token_ids == cold.outputs[0].token_ids


def test_perf_metrics_are_ordered(engine):
    m = _generate(engine, max_tokens=5, temperature=0.0, ignore_eos=True).metrics
    assert 0 < m.arrival_time_ns <= m.first_scheduled_time_ns <= m.first_token_time_ns <= m.last_token_time_ns
    assert m.num_prompt_tokens == len(PROMPT) and m.num_output_tokens == 5


@pytest.mark.parametrize("field, params, prompt", [
    ("prompt", {}, []),
    ("prompt", {}, [300]),
    ("prompt", {}, [5, -1, 7]),
    ("max_tokens", {"max_tokens": 0}, PROMPT),
    ("max_tokens", {"max_tokens": 500}, PROMPT),
    ("temperature", {"temperature": -1.0}, PROMPT),
    ("top_p", {"top_p": 0.0}, PROMPT),
    ("top_k", {"top_k": -2}, PROMPT),
    ("min_p", {"min_p": 1.5}, PROMPT),
    ("repetition_penalty", {"repetition_penalty": 0.0}, PROMPT),
    ("presence_penalty", {"presence_penalty": 3.0}, PROMPT),
    ("min_tokens", {"min_tokens": 50, "max_tokens": 10}, PROMPT),
    ("beam_width", {"beam_width": 9}, PROMPT),
    ("n", {"n": 0}, PROMPT),
    ("end_id", {"end_id": 256}, PROMPT),
    ("stop_token_ids", {"stop_token_ids": [[]]}, PROMPT),
    ("bad_token_ids", {"bad_token_ids": [[999]]}, PROMPT),
    ("stop_token_ids", {"stop_token_ids": [[3, -4]]}, PROMPT),
    ("top_k", {"top_k": 2 ** 63}, PROMPT),  # overflowed in the sampler and killed the loop
    ("top_k", {"top_k": 257}, PROMPT),
    ("seed", {"seed": 2 ** 64, "temperature": 1.0}, PROMPT),
    ("n", {"n": 10_000}, PROMPT),
    ("temperature", {"temperature": float("inf")}, PROMPT),
    ("length_penalty", {"length_penalty": float("nan")}, PROMPT),
    ("length_penalty", {"length_penalty": 2000.0, "beam_width": 2}, PROMPT),  # overflowed: the step failed
    ("length_penalty", {"length_penalty": -2000.0, "beam_width": 2}, PROMPT),  # divided by zero
    ("repetition_penalty", {"repetition_penalty": 1e-300}, PROMPT),  # logits seen turned inf: NaN draws
    ("repetition_penalty", {"repetition_penalty": 1e300}, PROMPT),
    ("stop_token_ids", {"stop_token_ids": [[5]] * 65}, PROMPT),
    ("bad_token_ids", {"bad_token_ids": [[5] * 257]}, PROMPT),
    ("top_logprobs", {"top_logprobs": 21}, PROMPT),
    ("top_logprobs", {"top_logprobs": -1}, PROMPT),
    ("top_logprobs", {"top_logprobs": 2, "beam_width": 2}, PROMPT),
    ("logit_bias", {"logit_bias": {256: 1.0}}, PROMPT),
    ("logit_bias", {"logit_bias": {5: 100.5}}, PROMPT),
    ("logit_bias", {"logit_bias": {5: float("nan")}}, PROMPT),
    ("logit_bias", {"logit_bias": dict.fromkeys(range(301), 1.0)}, PROMPT),
])
def test_bad_requests_name_the_field_and_engine_keeps_running(engine, greedy_tokens, field, params, prompt):
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", prompt, SamplingParams(**params))
    assert err.value.field == field and field in str(err.value)
    assert _generate(engine, max_tokens=24, temperature=0.0, ignore_eos=True).outputs[0].token_ids == greedy_tokens


def test_tiny_temperatures_are_greedy_and_large_seeds_reduce(engine, greedy_tokens):
    """1e-300 divides logits into NaNs; vLLM treats such temperatures as greedy, and so do we. A
    seed near 2**64 plus the output index wraps instead of overflowing the generator."""
    out = _generate(engine, max_tokens=24, temperature=1e-300, ignore_eos=True)
    assert out.outputs[0].token_ids == greedy_tokens
    out = _generate(engine, max_tokens=4, temperature=0.8, seed=2 ** 64 - 1, n=2)
    assert [len(o.token_ids) for o in out.outputs] == [4, 4]


def test_limits_are_named_in_messages(engine):
    with pytest.raises(InvalidRequestError, match="max_seq_len 512"):
        engine.add_request("long", PROMPT, SamplingParams(max_tokens=500))
    chunkless = make_engine(engine.model_dir, enable_chunked_prefill=False, max_num_tokens=16)
    with pytest.raises(InvalidRequestError, match="max_num_tokens 16"):
        chunkless.add_request("long", PROMPT, SamplingParams())
    capped = make_engine(engine.model_dir, max_input_len=len(PROMPT) - 1, max_output_len=8)
    with pytest.raises(InvalidRequestError, match=f"max_input_len of {len(PROMPT) - 1}"):
        capped.add_request("long", PROMPT, SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="max_output_len of 8"):
        capped.add_request("many", PROMPT[:-1], SamplingParams(max_tokens=9))
    capped.add_request("fits", PROMPT[:-1], SamplingParams(max_tokens=8))
    few = make_engine(engine.model_dir, max_logprobs=2)
    with pytest.raises(InvalidRequestError, match="max_logprobs of 2"):
        few.add_request("many", PROMPT, SamplingParams(logprobs=True, top_logprobs=3))
