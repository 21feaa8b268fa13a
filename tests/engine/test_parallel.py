"""Tensor and pipeline parallel engines (gloo on CPU, ranks as local processes) produce what one
device produces: greedy tokens equal transformers', logprobs and beams equal the single-device
engine's, LoRA adapters sharded with the layers, under preemption and block reuse."""
import pytest

from app.engine import SamplingParams, SchedulerPolicy
from tests.conftest import hf_greedy, make_engine, random_prompts, run_staggered
from tests.engine.test_lora import ADAPTERS, _run, adapter_dirs, expected  # noqa: F401 - fixtures

GREEDY = SamplingParams(max_tokens=20, temperature=0.0)
# A KV pool too small for every prompt at once: MAX_UTILIZATION preempts and resumes.
SMALL_POOL = dict(max_tokens=160, scheduler_policy=SchedulerPolicy.MAX_UTILIZATION, max_num_tokens=16)


def _prompts():
    prompts = random_prompts(6, 3, 40, vocab=256, seed=1)
    return prompts + [prompts[0][:24] + [7, 8, 9]]  # shares three full blocks with prompt 0


@pytest.fixture(scope="module", params=[(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2-pp2"])
def parallel_engine(request, tiny_llama_dir):
    tp, pp = request.param
    engine = make_engine(tiny_llama_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, max_loras=2,
                         **SMALL_POOL)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def single_engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir, max_loras=2, **SMALL_POOL)


def test_greedy_matches_transformers(parallel_engine, tiny_hf):
    expected = [hf_greedy(tiny_hf, p, GREEDY.max_tokens) for p in _prompts()]
    for _ in range(2):  # the second pass reuses the first pass's cached blocks
        outputs = run_staggered(parallel_engine, _prompts(), GREEDY, [0, 0, 1, 3, 3, 7, 12])
        assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = parallel_engine.stats()
    assert stats.reused_blocks_total > 0 and stats.num_preempted_total > 0
    assert stats.free_blocks == stats.max_blocks


def test_logprobs_and_beams_match_one_device(parallel_engine, single_engine):
    prompts = _prompts()[:3]
    for params in (SamplingParams(max_tokens=12, temperature=0.0, logprobs=True),
                   SamplingParams(max_tokens=10, beam_width=2, n=2, logprobs=True)):
        ours, ref = parallel_engine.generate(prompts, params), single_engine.generate(prompts, params)
        for a, b in zip(ours, ref):
            assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
            for ca, cb in zip(a.outputs, b.outputs):
                assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-4)


def test_adapters_are_sharded_with_the_layers(parallel_engine, adapter_dirs, expected):  # noqa: F811
    prompts, out = expected
    for name, path in adapter_dirs.items():
        parallel_engine.add_lora(name, path)
    pairs = [(i % 3, name) for i, name in enumerate(["a", "b", "c", "d", "e", "a", None, "d"])]
    assert _run(parallel_engine, prompts, pairs, [0, 0, 1, 2, 3, 4, 5, 6]) == [out[p] for p in pairs]


def test_a_split_the_model_cannot_take_is_refused(smollm2_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 must divide the model's num_attention_heads \(9\)"):
        make_engine(smollm2_dir, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size 64 exceeds the model's 30 layers"):
        make_engine(smollm2_dir, pipeline_parallel_size=64)
