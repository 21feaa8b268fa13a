"""Draft-target speculation: a draft model guesses, the target checks. The drafts here are the
targets with noise on their weights (a model that agrees with the target often, not always, as a
smaller model of the same family does): each run has guesses confirmed and rejected, and greedy
outputs must be plain decoding's token for token, and transformers'."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.engine import SamplingParams
from app.engine.config import SchedulerPolicy
from tests.conftest import hf_greedy_logprobs, make_engine, random_prompts, run_staggered


def noisy_copy(src, dst, scale: float, seed: int = 0):
    """`src`'s model with Gaussian noise of `scale` times each matrix's spread added to every
    matrix but the embeddings (which SmolLM2 ties to its output)."""
    dst.mkdir()
    generator = torch.Generator().manual_seed(seed)
    for file in src.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, dst / file.name)
            continue
        tensors = load_file(file)
        save_file({name: t + scale * t.std() * torch.randn(t.shape, generator=generator)
                   if t.dim() == 2 and "embed" not in name else t for name, t in tensors.items()}, dst / file.name)
    return dst


def draft_config(model_dir, max_draft_len: int = 4) -> dict:
    return {"decoding_type": "DraftTarget", "max_draft_len": max_draft_len, "speculative_model": str(model_dir)}


@pytest.fixture(scope="module")
def tiny_draft_dir(tiny_llama_dir, tmp_path_factory):
    return noisy_copy(tiny_llama_dir, tmp_path_factory.mktemp("tiny-draft") / "m", 0.3)


@pytest.fixture(scope="module")
def smollm2_draft_dir(smollm2_dir, tmp_path_factory):
    return noisy_copy(smollm2_dir, tmp_path_factory.mktemp("smollm2-draft") / "m", 0.03)


def record_proposals(engine) -> list[tuple[list[int], list[int]]]:
    """Every (tokens, guesses) the engine's draft model proposes, from now on."""
    proposer, seen = engine.proposer, []
    propose_all = proposer.propose_all

    def recording(wanted):
        drafts = propose_all(wanted)
        seen.extend((list(seq.token_ids), draft) for (seq, _), draft in zip(wanted, drafts))
        return drafts
    proposer.propose_all = recording
    return seen


def assert_draft_model_greedy(draft_dir, proposals) -> None:
    """Each proposal is the draft model's own greedy continuation of the tokens it was given, as
    transformers computes it from scratch (its end token included): the draft's KV cache held those
    tokens, position for position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    assert proposals
    with torch.inference_mode():
        for tokens, draft in proposals:
            ids = list(tokens)
            for _ in draft:
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            assert ids[len(tokens):] == draft


def _steps(engine, prompts, params):
    before = engine.num_steps
    return engine.generate(prompts, params), engine.num_steps - before


def test_greedy_with_a_draft_model_is_transformers_greedy_in_fewer_steps(smollm2_dir, smollm2_draft_dir,
                                                                         smollm2_tokenizer, smollm2_hf):
    text = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}],
                                                 add_generation_prompt=True, tokenize=False)
    prompt = smollm2_tokenizer.encode(text)
    tokens, logprobs = hf_greedy_logprobs(smollm2_hf, prompt, 32, smollm2_tokenizer.eos_token_id)
    engine = make_engine(smollm2_dir, tokens_per_block=16, speculative_config=draft_config(smollm2_draft_dir))
    (out,), steps = _steps(engine, [prompt], SamplingParams(max_tokens=32, temperature=0.0, logprobs=True))
    assert out.outputs[0].token_ids == tokens
    assert out.outputs[0].logprobs == pytest.approx(logprobs, abs=1e-3)
    m = out.metrics
    assert 0 < m.total_accepted_draft_tokens < m.total_draft_tokens  # guesses stood, and guesses fell
    assert steps < len(tokens) * 0.75, steps  # plain decoding takes a step a token
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_many_sequences_under_overlap_greedy_and_seeded_are_plain_decoding(tiny_llama_dir, tiny_draft_dir):
    """Six sequences at once, greedy and seeded sampled (whose rows draw what plain decoding draws
    at their positions), arriving together, the overlap scheduler on: plain decoding's tokens."""
    prompts = random_prompts(6, 5, 30, 256, seed=3)
    params = [SamplingParams(max_tokens=48, temperature=0.0)] * 3 + \
             [SamplingParams(max_tokens=48, temperature=0.8, seed=i, top_k=40) for i in range(3)]
    plain = make_engine(tiny_llama_dir).generate(prompts, params)
    engine = make_engine(tiny_llama_dir, speculative_config=draft_config(tiny_draft_dir))
    engine.overlap = True
    proposals = record_proposals(engine)
    for _ in range(2):  # the second time over blocks the first run left cached
        out = engine.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
        drafted = sum(o.metrics.total_draft_tokens for o in out)
        assert 0 < sum(o.metrics.total_accepted_draft_tokens for o in out) < drafted
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert_draft_model_greedy(tiny_draft_dir, proposals)


def test_preempted_sequences_draft_again_from_their_new_blocks(tiny_llama_dir, tiny_draft_dir):
    """A pool too small for every sequence at once under MAX_UTILIZATION: sequences are preempted
    and recomputed in other blocks, where the draft's KV is not theirs; it is computed again."""
    prompts = random_prompts(4, 20, 30, 256, seed=5)
    params = SamplingParams(max_tokens=60, temperature=0.0)
    plain = make_engine(tiny_llama_dir).generate(prompts, params)
    engine = make_engine(tiny_llama_dir, max_tokens=160, scheduler_policy=SchedulerPolicy.MAX_UTILIZATION,
                         speculative_config=draft_config(tiny_draft_dir))
    proposals = record_proposals(engine)
    out = engine.generate(prompts, params)
    assert engine.scheduler.num_preempted_total > 0
    assert_draft_model_greedy(tiny_draft_dir, proposals)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.total_accepted_draft_tokens for o in out) > 0


def test_long_catch_ups_run_as_prefill_chunks_and_spread_over_steps(tiny_llama_dir, tiny_draft_dir):
    """With max_batch_size 6, a first catch-up over a prompt of 20-30 tokens is a prefill chunk in
    the draft, in one batch with the other sequence's catch-up; with max_num_tokens 16 it takes two
    proposals, the first of which guesses nothing."""
    prompts = random_prompts(2, 20, 30, 256, seed=7)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    plain = make_engine(tiny_llama_dir).generate(prompts, params)
    engine = make_engine(tiny_llama_dir, max_batch_size=6, max_num_tokens=16,
                         speculative_config=draft_config(tiny_draft_dir, 2))
    proposals, batches = record_proposals(engine), []
    inputs = engine.proposer._inputs

    def recording(spans, tokens):
        batch, rows = inputs(spans, tokens)
        batches.append((batch.num_decodes, len(batch.prefills), [end - start for _, start, end in spans]))
        return batch, rows
    engine.proposer._inputs = recording
    out = run_staggered(engine, prompts, params, [0, 6])
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert any(chunks and len(lens) > 1 for _, chunks, lens in batches), batches  # beside another's span
    assert any(lens == [16] for _, _, lens in batches), batches  # a catch-up cut at max_num_tokens
    assert max(n for _, _, lens in batches for n in lens) <= 16
    assert_draft_model_greedy(tiny_draft_dir, proposals)


def test_a_failing_draft_costs_the_step_its_guesses_not_its_requests(tiny_llama_dir, tiny_draft_dir):
    prompts = random_prompts(2, 5, 12, 256, seed=9)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = make_engine(tiny_llama_dir).generate(prompts, params)
    engine = make_engine(tiny_llama_dir, speculative_config=draft_config(tiny_draft_dir))
    propose_all, calls = engine.proposer.propose_all, []

    def failing_once(wanted):
        calls.append(len(wanted))
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return propose_all(wanted)
    engine.proposer.propose_all = failing_once
    out = engine.generate(prompts, params)
    assert len(calls) > 2
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert engine.failed_steps == 0 and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_speculative_config_names():
    from app.engine.config import SpeculativeConfig

    config = SpeculativeConfig(decoding_type="DraftTarget", speculative_model_dir="/models/draft")
    assert config.speculative_model == "/models/draft"  # TensorRT-LLM's older name
    with pytest.raises(ValueError, match="not both"):
        SpeculativeConfig(decoding_type="DraftTarget", speculative_model="a", speculative_model_dir="b")
    with pytest.raises(ValueError, match="decoding_type 'Eagle' is not supported"):
        SpeculativeConfig(decoding_type="Eagle")


def test_the_draft_model_must_share_the_vocabulary(tiny_llama_dir, smollm2_dir):
    with pytest.raises(ValueError, match="speculative_model's vocabulary"):
        make_engine(tiny_llama_dir, speculative_config=draft_config(smollm2_dir))
    with pytest.raises(ValueError, match="speculative_model is required"):
        make_engine(tiny_llama_dir, speculative_config={"decoding_type": "DraftTarget"})
    with pytest.raises(ValueError, match="read with decoding_type DraftTarget only"):
        make_engine(tiny_llama_dir, speculative_config={"speculative_model": str(smollm2_dir)})
