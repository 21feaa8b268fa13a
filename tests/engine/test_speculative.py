"""N-gram speculation (prompt lookup): guesses from the sequence's own past, checked by the model in
the step that computes its last token. Greedy outputs are token for token those of plain decoding
and of transformers, in fewer steps, whatever ends them (max_tokens, a stop sequence, the end id).
Sampled outputs keep the model's distribution (measured on the acceptance rule), and seeded ones
are plain decoding's, draw for draw."""
import numpy as np
import pytest
import torch

from app.engine import SamplingParams
from app.engine.config import SpeculativeConfig
from app.engine.sampler import Sampler
from app.engine.sequence import Sequence
from app.engine.speculative import NGramProposer
from tests.conftest import hf_greedy, make_engine
from tests.engine.test_lora import adapter_dirs, expected  # noqa: F401 - fixtures

NGRAM = {"max_draft_len": 4, "max_matching_ngram_size": 3}
CODE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "def mul(a, b):\n    return a * b\n")


def test_the_proposer_takes_the_latest_match_of_the_longest_tail():
    propose = NGramProposer(SpeculativeConfig(max_draft_len=3, max_matching_ngram_size=2)).propose
    assert propose([1, 2, 3, 4, 5, 9, 2, 3], 10) == [4, 5, 9]  # the tail (2, 3) came before
    assert propose([7, 3, 8, 1, 2, 3, 4, 5, 9, 7, 3], 10) == [8, 1, 2]  # (7, 3) beats a later (3,)
    assert propose([3, 6, 1, 3, 5, 2, 3], 10) == [5, 2, 3]  # the latest (3,), not the first
    assert propose([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]  # no more than the limit
    assert propose([1, 2, 3], 10) == [] and propose([4], 10) == []
    # Token 256 is the bytes 00 01 00 00: a byte match across token boundaries is no match.
    assert propose([256, 1, 0, 0, 1, 0], 10) == [0, 1, 0]


def _target(logits: list[float], p: SamplingParams) -> np.ndarray:
    """The distribution plain sampling draws from, written out: temperature, top-k, top-p, min-p."""
    scaled = np.asarray(logits) / p.temperature
    order = np.argsort(-scaled)
    probs = np.exp(scaled[order] - scaled[order].max())
    probs[p.top_k:] = 0
    probs /= probs.sum()
    probs[np.cumsum(probs) - probs > p.top_p] = 0
    probs /= probs.sum()
    probs[probs < p.min_p * probs[0]] = 0
    target = np.zeros(len(scaled))
    target[order] = probs / probs.sum()
    return target


def test_sampled_guesses_keep_the_target_distribution():
    """The acceptance rule over the real sampler, N sequences x 3 rows of fixed logits (8 tokens,
    each row cut by top-k, top-p and min-p) and guesses [1, 4]. The first token taken must follow
    row 0's distribution p0, the second (only after guess 1 stood) p1, the bonus token after both
    stood p2. A rule that drew a rejected row from p instead of p without the guess would put
    p0(1) + (1 - p0(1)) p0(1) on token 1 (total variation p0(1)(1 - p0(1)) = 0.25 from p0); one
    that accepted every guess, 0.53."""
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.3)
    logits = [[2.0, 1.9, 0.9, 0.3, -0.2, -0.4, 1.0, -3.0],
              [0.1, 0.5, -1.0, 0.2, 1.4, 0.0, -2.5, 1.2],
              [-1.0, 0.0, 1.2, 1.1, -0.3, 0.6, 0.4, -0.8]]
    draft, n = [1, 4], 30000
    seqs = [Sequence(i, "r", 0, [0], params, frozenset(), None) for i in range(n)]
    rows = [seq for seq in seqs for _ in range(3)]
    tokens = Sampler(seed=0, device=torch.device("cpu"))(torch.tensor(logits).repeat(n, 1), rows).token_ids
    taken = [tokens[3 * i:3 * i + NGramProposer.confirmed(draft, tokens[3 * i:3 * i + 3]) + 1] for i in range(n)]
    targets = [_target(row, params) for row in logits]
    assert [int((t > 0).sum()) for t in targets] == [2, 3, 4]  # truncation bites in every row

    def distance(sample: list[int], target: np.ndarray) -> float:
        return 0.5 * np.abs(np.bincount(sample, minlength=len(target)) / len(sample) - target).sum()
    assert all(t[:-1] == draft[:len(t) - 1] for t in taken)  # a token taken after a row is its guess
    for position, target in enumerate(targets):
        sample = [t[position] for t in taken if len(t) > position]  # given the guesses before it stood
        assert distance(sample, target) < 0.03, (position, len(sample))
    assert sum(len(t) > 1 for t in taken) / n == pytest.approx(targets[0][draft[0]], abs=0.015)


def spoiled_answers(prompts, outputs, vocab: int = 256):
    """A proposer that knows each prompt's answer (`outputs`, plain decoding's) and spoils its last
    guess: each guessing step confirms some rows and rejects one, whatever the model."""
    answers = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outputs)}

    def propose(token_ids, limit):
        prompt = next(p for p in answers if tuple(token_ids[:len(p)]) == p)
        done = len(token_ids) - len(prompt)
        guess = answers[prompt][done:done + min(limit, 4)]
        return guess[:-1] + [(guess[-1] + 1) % vocab] if len(guess) > 1 else []
    return propose


def test_confirmed_and_rejected_guesses_under_overlap_give_plain_outputs(tiny_llama_dir):
    """Known guesses with a wrong last one, four sequences at once, the overlap scheduler on (forced
    here; CUDA's default): greedy tokens and logprobs are plain decoding's, blocks all come back."""
    from tests.conftest import random_prompts

    prompts = random_prompts(4, 5, 12, 256, seed=11)
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=True)
    plain = make_engine(tiny_llama_dir).generate(prompts, params)
    engine = make_engine(tiny_llama_dir, speculative_config=NGRAM)
    engine.overlap = True
    engine.proposer.propose = spoiled_answers(prompts, plain)
    guessed = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in guessed] == [o.outputs[0].token_ids for o in plain]
    for a, b in zip(guessed, plain):
        assert a.outputs[0].logprobs == pytest.approx(b.outputs[0].logprobs, abs=1e-4)
    drafted = sum(o.metrics.total_draft_tokens for o in guessed)
    assert 0 < sum(o.metrics.total_accepted_draft_tokens for o in guessed) < drafted
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampled_guesses_give_plain_sampled_outputs_under_overlap(tiny_llama_dir):
    """Seeded sampled requests (temperature, top-k, top-p, min-p, logit bias, then a one-token bad
    word) guess, with confirmed and rejected guesses, under the overlap scheduler: each row draws
    what plain decoding draws at its position, and the generator goes back past the rows dropped,
    so the outputs are plain decoding's token for token, run after run. An unseeded one guesses too."""
    from tests.conftest import random_prompts

    prompts = random_prompts(5, 5, 12, 256, seed=11)
    params = [SamplingParams(max_tokens=40, temperature=0.9, seed=1, logprobs=True),
              SamplingParams(max_tokens=40, temperature=0.9, seed=2, top_k=20, top_p=0.9),
              SamplingParams(max_tokens=40, temperature=1.2, seed=3, top_p=0.95, min_p=0.05),
              SamplingParams(max_tokens=40, temperature=0.9, seed=4, logit_bias={7: 3.0}),
              SamplingParams(max_tokens=40, temperature=0.9)]
    banned = SamplingParams(max_tokens=40, temperature=0.9, seed=5, bad_token_ids=[[9]])  # steps serially
    plain_engine = make_engine(tiny_llama_dir)
    plain, (plain_banned,) = plain_engine.generate(prompts, params), plain_engine.generate(prompts[:1], banned)
    engine = make_engine(tiny_llama_dir, speculative_config=NGRAM)
    engine.overlap = True
    for _ in range(2):
        engine.proposer.propose = spoiled_answers(prompts, plain)
        guessed = engine.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in guessed[:4]] == [o.outputs[0].token_ids for o in plain[:4]]
        assert guessed[0].outputs[0].logprobs == pytest.approx(plain[0].outputs[0].logprobs, abs=1e-4)
        assert all(0 < o.metrics.total_accepted_draft_tokens < o.metrics.total_draft_tokens for o in guessed[:4])
        assert guessed[4].metrics.total_draft_tokens > 0
        engine.proposer.propose = spoiled_answers(prompts[:1], [plain_banned])
        (out,) = engine.generate(prompts[:1], banned)
        assert out.outputs[0].token_ids == plain_banned.outputs[0].token_ids and 9 not in out.outputs[0].token_ids
        assert out.metrics.total_accepted_draft_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_seeded_request_draws_the_same_whether_a_neighbour_truncates(tiny_llama_dir):
    """A seeded request's draws do not depend on its batch: beside a top-k request that ends early,
    guessing moves the steps at which the two share a batch, and the plain request's output is still
    plain decoding's (the noise is drawn in vocabulary order whether or not some row sorts)."""
    from tests.conftest import random_prompts

    prompts = random_prompts(2, 5, 12, 256, seed=11)
    params = [SamplingParams(max_tokens=40, temperature=0.9, seed=1),
              SamplingParams(max_tokens=4, temperature=0.9, seed=2, top_k=20)]
    plain = make_engine(tiny_llama_dir).generate(prompts, params)
    alone = make_engine(tiny_llama_dir).generate(prompts[:1], params[:1])
    assert alone[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    engine = make_engine(tiny_llama_dir, speculative_config=NGRAM)
    engine.proposer.propose = spoiled_answers(prompts, plain)
    guessed = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in guessed] == [o.outputs[0].token_ids for o in plain]
    assert guessed[0].metrics.total_accepted_draft_tokens > 0


def _chat(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text)


@pytest.fixture(scope="module")
def copy_prompt(smollm2_tokenizer):
    return _chat(smollm2_tokenizer, "Repeat this code exactly, then stop:\n" + CODE)


@pytest.fixture(scope="module")
def engines(smollm2_dir):
    plain = make_engine(smollm2_dir, tokens_per_block=16)
    guessing = make_engine(smollm2_dir, tokens_per_block=16, speculative_config=NGRAM)
    return plain, guessing


def _run(engine, prompts, params):
    steps = engine.num_steps
    outputs = engine.generate(prompts, params)
    return outputs, engine.num_steps - steps


def test_greedy_output_equals_plain_decoding_and_transformers_in_fewer_steps(engines, copy_prompt, smollm2_hf):
    plain, guessing = engines
    params = SamplingParams(max_tokens=60, temperature=0.0, logprobs=True, top_logprobs=2)
    (expected,), plain_steps = _run(plain, [copy_prompt], params)
    (out,), steps = _run(guessing, [copy_prompt], params)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids == hf_greedy(smollm2_hf, copy_prompt, 60)
    m = out.metrics
    assert m.total_draft_tokens > 0 and 0 < m.total_accepted_draft_tokens <= m.total_draft_tokens
    assert m.acceptance_rate == m.total_accepted_draft_tokens / m.total_draft_tokens
    assert steps < plain_steps * 0.75, (steps, plain_steps)  # one prefill step, then the decodes
    # A confirmed guess's logprobs come from its own row: those decoding computes, within float32 noise.
    for a, b in zip(out.outputs[0].logprobs, expected.outputs[0].logprobs):
        assert abs(a - b) < 1e-3
    assert [ids for ids, _ in out.outputs[0].top_logprobs] == [ids for ids, _ in expected.outputs[0].top_logprobs]


@pytest.mark.parametrize("ending", ["max_tokens", "stop", "eos"])
def test_an_end_inside_the_confirmed_guesses_ends_the_output_there(engines, copy_prompt, smollm2_tokenizer, ending):
    """max_tokens, a stop sequence or the end id among the tokens one step confirms: the output ends
    where plain decoding ends it, and the sequence's blocks go back."""
    plain, guessing = engines
    if ending == "eos":  # an answer SmolLM2 ends itself, 12 tokens long, most of them confirmed guesses
        copy_prompt = _chat(smollm2_tokenizer, "Fix the typo and repeat the sentence: The cat sat on teh mat "
                                               "and looked at the door.")
    (reference,), _ = _run(plain, [copy_prompt], SamplingParams(max_tokens=120, temperature=0.0))
    tokens = reference.outputs[0].token_ids
    params = {"max_tokens": SamplingParams(max_tokens=23, temperature=0.0),
              "stop": SamplingParams(max_tokens=120, temperature=0.0, stop_token_ids=[tokens[30:32]]),
              "eos": SamplingParams(max_tokens=120, temperature=0.0)}[ending]
    (expected,), _ = _run(plain, [copy_prompt], params)
    (out,), _ = _run(guessing, [copy_prompt], params)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == \
        (expected.outputs[0].finish_reason, expected.outputs[0].stop_reason)
    if ending == "eos":
        assert expected.outputs[0].finish_reason == "stop" and out.metrics.total_accepted_draft_tokens > 0
    assert guessing.block_manager.num_free_blocks == guessing.block_manager.num_blocks


def test_guesses_mix_with_sampled_requests_and_leave_the_prefix_cache_sound(engines, copy_prompt):
    """A batch of greedy and seeded sampled requests, all guessing on a prompt to copy: outputs are
    plain decoding's (the sampled one's too, draw for draw); run again, the second round reuses the
    cached blocks the first wrote (rejected guesses' KV never entered the cache) and answers the same."""
    plain, guessing = engines
    greedy = SamplingParams(max_tokens=48, temperature=0.0)
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=5)
    prompts = [copy_prompt, copy_prompt[:-7], copy_prompt]
    params = [greedy, greedy, sampled]
    expected, _ = _run(plain, prompts, params)
    first, _ = _run(guessing, prompts, params)
    second, _ = _run(guessing, prompts, params)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in expected]
    assert all(o.metrics.kv_cache_reused_blocks > 0 for o in second)
    assert first[2].metrics.total_accepted_draft_tokens > 0  # sampling guesses, and copies


def test_requests_whose_processing_reads_earlier_tokens_do_not_guess(engines, copy_prompt):
    """Penalties and bad words longer than a token depend on the tokens before a row, which the
    sampler reads from the host, without the guesses; before min_tokens each row would ban the end
    id or not. (Logit bias and one-token bad words do not: such requests guess.)"""
    _, guessing = engines
    for params in (SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.2),
                   SamplingParams(max_tokens=16, temperature=0.0, bad_token_ids=[[5, 6]]),
                   SamplingParams(max_tokens=16, temperature=0.0, min_tokens=8, ignore_eos=False)):
        (out,), _ = _run(guessing, [copy_prompt], params)
        guessed = out.metrics.total_draft_tokens
        assert guessed == 0 if params.min_tokens == 0 else guessed > 0  # past min_tokens, a plain greedy one does


def test_guessing_and_overlapped_steps_take_turns(engines, copy_prompt, smollm2_tokenizer):
    """Under the overlap scheduler (on by default on CUDA, forced here): a step that guesses needs the
    last token read back, so it runs alone; a sequence whose guesses miss pauses guessing and its
    steps overlap again. Outputs stay plain decoding's."""
    plain, guessing = engines
    prompts = [copy_prompt, _chat(smollm2_tokenizer, "Write a short poem about the sea.")]
    params = SamplingParams(max_tokens=64, temperature=0.0)
    launched = []
    launch = guessing.runner.launch
    guessing.runner.launch = lambda *args, **kwargs: launched.append(1) or launch(*args, **kwargs)
    plain.overlap = guessing.overlap = True
    try:
        expected, _ = _run(plain, prompts, params)
        outputs, _ = _run(guessing, prompts, params)
    finally:
        plain.overlap = guessing.overlap = False
        guessing.runner.launch = launch
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert sum(o.metrics.total_accepted_draft_tokens for o in outputs) > 0 and len(launched) > 0


def test_a_batch_too_large_to_guess_keeps_overlapping(tiny_llama_dir):
    """Four decodes of five rows each outgrow max_batch_size 8: nobody guesses, and the overlap
    scheduler keeps running (a sequence that could guess but is not allowed to must not hold it)."""
    from tests.conftest import random_prompts

    prompts = random_prompts(4, 5, 12, 256, seed=12)
    params = SamplingParams(max_tokens=30, temperature=0.0)
    plain = make_engine(tiny_llama_dir, max_batch_size=8).generate(prompts, params)
    engine = make_engine(tiny_llama_dir, max_batch_size=8, speculative_config=NGRAM)
    engine.overlap = True
    engine.proposer.propose = spoiled_answers(prompts, plain)  # it would guess, were it allowed
    launched = []
    launch = engine.runner.launch
    engine.runner.launch = lambda *args, **kwargs: launched.append(1) or launch(*args, **kwargs)
    outputs = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.total_draft_tokens for o in outputs) == 0 and len(launched) >= 25


def test_guesses_under_preemption_give_plain_outputs(tiny_llama_dir):
    """MAX_UTILIZATION over a pool too small for the batch: sequences are preempted and recomputed
    while others guess (a guess never takes a new block there); outputs are plain decoding's."""
    from tests.conftest import random_prompts

    prompts = random_prompts(6, 30, 40, 256, seed=13)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    tight = dict(max_tokens=256, scheduler_policy="MAX_UTILIZATION")
    plain_engine = make_engine(tiny_llama_dir, **tight)
    plain = plain_engine.generate(prompts, params)
    engine = make_engine(tiny_llama_dir, speculative_config=NGRAM, **tight)
    engine.proposer.propose = spoiled_answers(prompts, plain)
    outputs = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert engine.scheduler.num_preempted_total > 0 and sum(o.metrics.total_accepted_draft_tokens for o in outputs) > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_guesses_ride_with_lora_adapters(tiny_llama_dir, adapter_dirs, expected):  # noqa: F811
    """Each guess row carries its sequence's adapter: mixed adapters answer as peft does."""
    from app.engine.outputs import CompletionOutput, RequestOutput

    prompts, out = expected
    pairs = [(0, "a"), (1, None), (2, "b"), (0, "d")]
    engine = make_engine(tiny_llama_dir, speculative_config=NGRAM)
    for name in ("a", "b", "d"):
        engine.add_lora(name, adapter_dirs[name])
    answers = [RequestOutput("", [CompletionOutput(0, out[pair], None, 0.0, None)], True) for pair in pairs]
    engine.proposer.propose = spoiled_answers([prompts[i] for i, _ in pairs], answers)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    for k, (i, name) in enumerate(pairs):
        engine.add_request(f"r{k}", prompts[i], params, adapter_id=name)
    tokens, drafted = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            drafted += o.metrics.total_draft_tokens if o.finished else 0
    assert [tokens[f"r{k}"] for k in range(len(pairs))] == [out[pair] for pair in pairs] and drafted > 0
