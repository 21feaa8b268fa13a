"""The engine on a CUDA device against transformers on the same device (skipped without one;
run on the GPU machines: `pytest tests/engine/test_gpu.py`)."""
import importlib.util
import itertools

import pytest
import torch

from app.engine import EngineConfig, LLMEngine, SamplingParams
from tests.conftest import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Guided decoding's grammars: scripts/setup.sh installs xgrammar; on the device machine it comes with
# the third carry of tools/gpu/wheels.sh.
needs_xgrammar = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None, reason="needs xgrammar")


def _engine(model_dir, dtype: str, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype=dtype,
                                  kv_cache_config={"max_tokens": 8192, "tokens_per_block": 16}, **overrides))


def test_greedy_tokens_equal_transformers_in_float32(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).cuda().eval()
    prompts = random_prompts(8, 3, 40, 256, seed=3)
    outs = _engine(tiny_llama_dir, "float32").generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensor_parallel_on_two_gpus_equals_one(tiny_llama_dir):
    """TP=2 over NCCL (ranks as local processes, decode from CUDA graphs with the all-reduce inside):
    the same greedy tokens as one GPU, logprobs equal within float32 reduction-order noise."""
    prompts = random_prompts(8, 3, 40, 256, seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=True)
    one = _engine(tiny_llama_dir, "float32").generate(prompts, params)
    two_engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype="float32",
                                        tensor_parallel_size=2,
                                        kv_cache_config={"max_tokens": 8192, "tokens_per_block": 16}))
    two = two_engine.generate(prompts, params)
    two_engine.shutdown()
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == pytest.approx(b.outputs[0].logprobs, abs=1e-3)


def test_a_pool_of_all_free_memory_leaves_room_for_the_largest_step(tiny_llama_dir):
    """free_gpu_memory_fraction 1.0: the pool takes what the weights and the largest step leave (the
    step is measured at start-up, then run once over the pool), so a step of max_num_tokens still
    runs. A pool sized without the step left it nothing. (1.0 is an edge: the sampler's memory is
    not measured, and this model's is small.)"""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype="bfloat16", max_num_tokens=4096,
                                    cuda_graphs=False,  # no graph capture's leftovers in the allocator to lean on
                                    kv_cache_config={"free_gpu_memory_fraction": 1.0, "tokens_per_block": 16}))
    prompts = random_prompts(8, 500, 500, 256, seed=9)  # 4,000 tokens: one prefill step
    outputs = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert [len(out.outputs[0].token_ids) for out in outputs] == [4] * 8


def test_overlapped_steps_equal_serial_steps(tiny_llama_dir):
    """On CUDA steps overlap by default (step k + 1 queued before step k is read back): in float32,
    a mixed load (greedy and seeded sampling, stops, n=2, one request that turns overlap off) gives
    the serial engine's tokens, with the pool preempting."""
    from tests.conftest import mixed_sampling_params, run_staggered

    prompts = random_prompts(24, 3, 60, 256, seed=21)
    runs = {}
    for disable in (True, False):
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype="float32",
                                        disable_overlap_scheduler=disable, scheduler_policy="MAX_UTILIZATION",
                                        max_batch_size=16, max_num_tokens=96,
                                        kv_cache_config={"max_tokens": 512, "tokens_per_block": 16}))
        assert engine.overlap is not disable
        arrivals = [i // 3 for i in range(len(prompts))]
        outputs = run_staggered(engine, prompts, mixed_sampling_params(len(prompts)), arrivals)
        runs[disable] = [[(c.token_ids, c.finish_reason) for c in out.outputs] for out in outputs]
        assert engine.stats().used_blocks == 0
    assert runs[False] == runs[True]


def test_late_planning_plans_each_step_near_the_end_of_the_one_computing(tiny_llama_dir, monkeypatch):
    """Every step made about 20 ms long on the device (a sleep queued before it): the step clock
    learns that from the steps' CUDA events; a loop that waits for LLMEngine.seconds_to_plan plans
    each step late in the one computing, yet the device never waits for it; a request added during
    such a wait, while step k still computes, makes step k + 1; and the tokens are those of planning
    each step at once."""
    import time

    from app.engine.outputs import merge_outputs

    sleep_cycles = 40_000_000  # ~20 ms at ~2 GHz (the stream gate test's 200M cycles took ~0.1 s)
    prompts = random_prompts(5, 8, 16, 256, seed=12)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = {}
    for late in (False, True):
        engine = _engine(tiny_llama_dir, "float32", late_planning=late)
        execute = engine.runner.shard.execute
        monkeypatch.setattr(engine.runner.shard, "execute",
                            lambda *a, run=execute, **k: (torch.cuda._sleep(sleep_cycles), run(*a, **k))[1])
        for i, prompt in enumerate(prompts[:4]):
            engine.add_request(f"r{i}", prompt, params)
        merged, waits, joined = {}, [], None
        while engine.has_unfinished_requests():
            wait = engine.seconds_to_plan()
            waits.append(wait)
            if wait > 0 and joined is None and engine.num_steps > 6:  # a request arrives mid-step
                time.sleep(wait / 2)
                assert not engine._in_flight.sample.done()
                engine.add_request("r4", prompts[4], params)
                time.sleep(max(0.0, engine.seconds_to_plan()))
                outputs = engine.step()  # reads step k back: the step it launched is k + 1
                # r4 came while step k computed and joined k + 1 (planned at once, k + 1 would have
                # been planned before r4 came, and r4 would have waited for k + 2).
                joined = any(item.seq.request_id == "r4" for item in engine._in_flight.plan.scheduled)
            else:
                time.sleep(wait)
                outputs = engine.step()
            for out in outputs:
                merged[out.request_id] = merge_outputs(merged.get(out.request_id), out)
        runs[late] = [merged[rid].outputs[0].token_ids for rid in sorted(merged)]
        if late:
            clock = engine.clock
            assert clock.estimates[4] > 0.015, clock.estimates  # four decode rows: ~20 ms of sleep and more
            assert sum(wait > 0.010 for wait in waits) >= 10, waits  # decode steps planned past half the one computing
            assert clock.queued_late <= 1, (clock.queued, clock.queued_late)
            assert joined  # r4 arrived while step k computed and made step k + 1
        else:
            assert all(wait == 0.0 for wait in waits)
    assert runs[True][:4] == runs[False]
    plain = _engine(tiny_llama_dir, "float32").generate([prompts[4]], params)
    assert runs[True][4] == plain[0].outputs[0].token_ids


def test_a_stream_gate_holds_queued_work_until_opened_and_never_moves_back():
    """Work queued behind a gate waits for the host. Then, with the device busy (a sleep queued
    first), two tickets are opened late one first: the earlier must not pull the gate back, or the
    later one's wait would never end."""
    import time

    from app.engine.stream_gate import StreamGate

    def finishes(event, seconds=10.0) -> bool:
        deadline = time.monotonic() + seconds
        while not event.query() and time.monotonic() < deadline:
            time.sleep(0.01)
        return event.query()

    gate, x = StreamGate(torch.device("cuda")), torch.zeros(1, device="cuda")
    x.add_(1)  # kernels launched behind a closed gate are loaded first: a first load waits for the device
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    held = gate.close()
    x.add_(1)
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.2)
    assert not done.query()
    gate.open(held)
    assert finishes(done) and x.item() == 2

    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time: both waits below are queued, neither reached
    first = gate.close()
    x.add_(1)
    second = gate.close()
    x.add_(1)
    done.record()
    gate.open(second)
    gate.open(first)
    passed = finishes(done)
    gate.open(second + 1000)  # whatever happened, nothing stays held for the tests after this one
    assert passed and x.item() == 4


@pytest.fixture(scope="module")
def tiny_tokenized_llama_dir(tmp_path_factory):
    """A 2-layer random Llama over a synthetic byte-level tokenizer of 4,096 ids
    (tools/gpu/make_tokenizer.py): a model that guided decoding can serve without SmolLM2's files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tools.gpu.make_tokenizer import write

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny-tokenized-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return write(path)


@needs_xgrammar
def test_guided_masks_filled_behind_a_stream_gate_equal_masks_filled_first(tiny_tokenized_llama_dir, monkeypatch):
    """On CUDA a guided step's sampling is queued before its masks are filled: a thread fills them
    and opens a gate on the stream. Overlapped, in float32, guided requests (greedy and seeded
    sampling) among free ones arriving over time take the tokens they take with the masks filled
    before anything is queued, and every guided answer is an object of the schema."""
    import json
    import time

    from app.engine import sampler
    from app.engine.guided import Guide, fill_bitmask
    from app.engine.stream_gate import StreamGate
    from app.text import Tokenizer
    from tests.conftest import run_staggered

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}},
              "required": ["name", "ok", "size"], "additionalProperties": False}
    guide = Guide("json_schema", json.dumps(schema), "guided_json")
    prompts = random_prompts(12, 3, 40, 4096, seed=31)
    params = [SamplingParams(max_tokens=48, temperature=0.0 if i % 3 == 0 else 0.8, seed=i, ignore_eos=True,
                             guide=None if i % 3 == 2 else guide) for i in range(len(prompts))]
    def slow_fill(*args):  # a gate that did not hold would let the copy read a mask not yet filled
        time.sleep(0.02)
        fill_bitmask(*args)

    runs = {}
    for gated in (False, True):
        with monkeypatch.context() as patch:
            if gated:
                patch.setattr(sampler, "fill_bitmask", slow_fill)
            else:
                patch.setattr(StreamGate, "for_device", classmethod(lambda cls, device: None))
            engine = _engine(tiny_tokenized_llama_dir, "float32", max_batch_size=8)
            assert (engine.runner.sampler._gate is not None) is gated and engine.overlap
            engine.grammars.compile(guide).result()  # compiled before any request: each joins when it arrives
            outputs = run_staggered(engine, prompts, params, [i // 2 for i in range(len(prompts))])
            engine.shutdown()
        runs[gated] = [out.outputs[0].token_ids for out in outputs]
    assert runs[True] == runs[False]
    tokenizer = Tokenizer(tiny_tokenized_llama_dir)
    for ids, p in zip(runs[True], params):
        if p.guide is not None:
            answer = json.loads(tokenizer.decode(ids))  # strict: no raw control character in a string
            assert set(answer) == {"name", "ok", "size"} and len(answer["name"]) <= 12, answer
            assert isinstance(answer["ok"], bool) and answer["size"] in ("s", "m", "l"), answer


@needs_xgrammar
def test_a_mask_fill_that_fails_fails_its_step_alone_and_opens_the_gate(tiny_tokenized_llama_dir, monkeypatch):
    """A fill that raises on its thread still opens its gate: the requests of the step it served end
    with the error, and requests after them run to the end (no stream left waiting)."""
    import json

    from app.engine import sampler
    from app.engine.guided import Guide, fill_bitmask

    fills = []

    def fill_failing_once(*args):
        fills.append(1)
        if len(fills) == 3:
            raise RuntimeError("mask fill failed")
        fill_bitmask(*args)

    monkeypatch.setattr(sampler, "fill_bitmask", fill_failing_once)
    engine = _engine(tiny_tokenized_llama_dir, "float32", max_batch_size=8)
    guide = Guide("json_schema", json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                             "required": ["ok"], "additionalProperties": False}), "guided_json")
    engine.grammars.compile(guide).result()
    prompts = random_prompts(5, 3, 20, 4096, seed=41)

    def run(ids, params):
        for i in ids:
            engine.add_request(f"r{i}", prompts[i], params[i])
        ended = {}
        while engine.has_unfinished_requests():
            ended.update((out.request_id, out) for out in engine.step() if out.finished)
        return ended

    params = [SamplingParams(max_tokens=24, temperature=0.0, guide=guide if i != 4 else None) for i in range(5)]
    first = run([0, 1], params)
    assert len(first) == 2 and all("failed" in (out.error or "") for out in first.values())
    second = run([2, 3, 4], params)
    engine.shutdown()
    assert len(second) == 3 and all(out.error is None for out in second.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_steps_from_piecewise_graphs_equal_op_by_op(tiny_llama_dir, monkeypatch, dtype):
    """Steps that carry prefill chunks replay the trunk from graphs cut at each attention call: on a
    staggered mixed load (chunked prompts beside decodes, sampling, stops, n=2) the tokens equal the
    engine that launches those steps op by op, and logprobs agree within the dtype's rounding (a
    padded bucket may pick other GEMM kernels)."""
    from app.engine.piecewise_graphs import PiecewiseGraphs
    from tests.conftest import mixed_sampling_params, run_staggered

    replayed = []
    run = PiecewiseGraphs.run
    monkeypatch.setattr(PiecewiseGraphs, "run", lambda self, ids, *a: replayed.append(len(ids)) or run(self, ids, *a))
    prompts = random_prompts(24, 3, 120, 256, seed=22)
    runs = {}
    for max_tokens in (0, 128):
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype=dtype, max_batch_size=16,
                                        max_num_tokens=160, piecewise_graph_max_tokens=max_tokens,
                                        kv_cache_config={"max_tokens": 4096, "tokens_per_block": 16}))
        arrivals = [i // 3 for i in range(len(prompts))]
        outputs = run_staggered(engine, prompts, mixed_sampling_params(len(prompts)), arrivals)
        runs[max_tokens] = [[(c.token_ids, c.finish_reason, c.logprobs) for c in out.outputs] for out in outputs]
        assert engine.stats().used_blocks == 0
    assert replayed and max(replayed) <= 128 and any(n not in (16, 32, 64, 128) for n in replayed)  # padded too
    tolerance = 1e-4 if dtype == "float32" else 0.05
    for eager, graphed in zip(runs[0], runs[128]):
        for (tokens, finish, logprobs), (g_tokens, g_finish, g_logprobs) in zip(eager, graphed):
            if dtype == "float32":  # bf16's rounding may flip a near tie, and the texts part there
                assert (tokens, finish) == (g_tokens, g_finish)
            same = next((i for i, (a, b) in enumerate(zip(tokens, g_tokens)) if a != b), len(tokens))
            assert logprobs[:same] == pytest.approx(g_logprobs[:same], abs=tolerance)


def test_piecewise_graphs_hold_one_set_of_what_crosses_a_cut(tiny_llama_dir):
    """Each layer's q, k and v (read by attention between pieces) and the trunk's output live in one
    static set sized for the largest bucket, so the graphs' memory grows with the largest bucket:
    buckets to 2,048 tokens take a few MB more than buckets to 256, where keeping those tensors per
    bucket held them once for every bucket (26 MB more on this model; 12.9 GiB of an H200's KV pool
    on the 8B shape). Both what stays allocated and what the graphs' pool reserves are measured: the
    second also shows that a bucket's freed blocks serve the next bucket's capture."""
    import gc

    from app.engine.piecewise_graphs import PiecewiseGraphs, token_buckets

    engine = _engine(tiny_llama_dir, "float32", piecewise_graph_max_tokens=0)
    shard = engine.runner.shard
    model, cfg = shard.model, shard.model.config
    kv_caches = list(shard.kv_cache.unbind(0))
    scratch_slot = (shard.kv_cache.shape[2] - 1) * shard.block_size
    # One capture stream for every construction: cuBLAS keeps a workspace per stream (tens of MB on a
    # Hopper card), which a fresh stream would add to one measurement and not the other.
    stream = torch.cuda.Stream(shard.device)

    def taken(max_tokens: int) -> tuple[int, int]:
        """(allocated, reserved) bytes that graphs to max_tokens take while they live"""
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        graphs = PiecewiseGraphs(model, kv_caches, max_tokens, scratch_slot, torch.float32, shard.device,
                                 stream=stream)
        torch.cuda.empty_cache()  # what is left reserved is the graphs' pool
        after = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        del graphs
        return after[0] - before[0], after[1] - before[1]

    taken(16)  # the stream's cuBLAS workspace
    small, large = taken(256), taken(2048)
    # What per-bucket tensors would hold beyond the 256-token graphs: every layer's qkv projection and the
    # trunk's (x, residual), in float32, for each token of each bucket the larger graphs add.
    per_token = 4 * (cfg.num_layers * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + 2 * cfg.hidden_size)
    per_bucket = per_token * (sum(token_buckets(2048)) - sum(token_buckets(256)))
    engine.shutdown()
    assert per_bucket > 20e6
    assert large[0] - small[0] < per_bucket / 4  # H200: 2.3 MB; 26.7 MB with per-bucket tensors
    # The pool keeps what the largest bucket's capture needed at its peak (its MLP activations among
    # them), about as much again as the per-bucket tensors on this model: 25 MB more on an H200, where
    # per-bucket tensors took 48 MB more, and a pool whose freed blocks went unused would take more still.
    assert large[1] - small[1] < 1.5 * per_bucket


def test_logprobs_within_bfloat16_tolerance(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).cuda().eval()
    prompts = random_prompts(8, 3, 40, 256, seed=4)
    outs = _engine(tiny_llama_dir, "bfloat16").generate(prompts, SamplingParams(max_tokens=1, temperature=0.0,
                                                                                 logprobs=True))
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
        reference = torch.log_softmax(logits, -1)
        token = out.outputs[0].token_ids[0]
        assert abs(out.outputs[0].logprobs[0] - reference[token].item()) < 0.05
        assert reference[token] >= reference.max() - 0.05  # greedy up to bf16 ties


def test_chunked_prefill_over_a_cached_prefix_equals_whole_prompt_prefill(tiny_llama_dir):
    """Prompts prefilled 48 tokens a step, so every chunk after the first attends to a cached prefix
    (the varlen kernel reading keys from the paged cache), against the same prompts prefilled whole:
    the same first tokens and logprobs (flash attention reads a query's keys in the same order either
    way), and both within bf16 rounding of transformers in float32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).cuda().eval()
    prompts = random_prompts(6, 100, 200, 256, seed=6)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True)

    def first_tokens(max_num_tokens: int) -> list[tuple[int, float]]:
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype="bfloat16",
                                        max_num_tokens=max_num_tokens,
                                        kv_cache_config={"max_tokens": 8192, "tokens_per_block": 16}))
        return [(out.outputs[0].token_ids[0], out.outputs[0].logprobs[0]) for out in engine.generate(prompts, params)]

    chunked, whole = first_tokens(48), first_tokens(2048)
    for prompt, (token, logprob), (whole_token, whole_logprob) in zip(prompts, chunked, whole):
        assert token == whole_token
        assert logprob == pytest.approx(whole_logprob, abs=1e-3)
        with torch.inference_mode():
            reference = torch.log_softmax(hf(torch.tensor([prompt], device="cuda")).logits[0, -1], -1)
        # bf16 rounding over 100-200 tokens of this random model: up to 0.1 measured on H100.
        assert abs(logprob - reference[token].item()) < 0.15


def test_mixture_of_experts_equals_transformers_and_replays_from_cuda_graphs_in_bfloat16(tmp_path):
    """float32: the grouped GEMM's portable loop, exact against transformers. bfloat16 on Hopper: the
    native grouped GEMM needs nothing from the host, so decode steps replay from CUDA graphs, with
    the tokens and logprobs of the same engine stepping eagerly (a tiny random mixture's routing is
    too close to ties for bf16 to follow transformers token by token)."""
    import transformers

    torch.manual_seed(1)
    config = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                        num_experts_per_tok=2, sliding_window=None, initializer_range=0.2,
                                        eos_token_id=1)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    prompts = random_prompts(8, 3, 40, 256, seed=3)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()
    for prompt, out in zip(prompts, _engine(tmp_path, "float32").generate(prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24)

    graphed = _engine(tmp_path, "bfloat16")
    assert graphed.runner.shard.graphs is not None
    _assert_same_greedy(graphed.generate(prompts, params),
                        _engine(tmp_path, "bfloat16", cuda_graphs=False).generate(prompts, params))


def _assert_same_greedy(outputs, reference) -> None:
    for out, ref in zip(outputs, reference):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert max(abs(a - b) for a, b in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs)) < 0.05


def test_lora_slots_equal_peft_and_replay_from_cuda_graphs_in_bfloat16(tiny_llama_dir, tmp_path, monkeypatch):
    """Mixed adapters (ranks 4 and 8) and base rows in one batch, through the slot kernels, the LoRA
    decode graphs and the LoRA pieces of steps with prefill chunks (requests arrive two a step, so
    prompts meet decodes; two long prompts together fill a bucket past 256 rows, where the kernels
    take larger blocks): in float32 exact against peft; in bfloat16 the same tokens and logprobs
    as the engine stepping eagerly."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from app.engine.piecewise_graphs import PiecewiseGraphs
    from tests.conftest import run_staggered

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for name, rank in (("r4", 4), ("r8", 8)):
        torch.manual_seed(rank)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama_dir),
                               LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False))
        for module in model.modules():
            if hasattr(module, "lora_B"):
                for b in module.lora_B.values():
                    torch.nn.init.normal_(b.weight, std=0.5)
        model.save_pretrained(tmp_path / name)
    prompts = random_prompts(6, 3, 40, 256, seed=6)
    prompts[2:4] = random_prompts(2, 180, 220, 256, seed=7)
    adapters = ["r4", "r8", None, "r8", "r4", None]
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=True)
    adapted_pieces = []  # (rows, decode rows, prefill chunks) of each piecewise step that carried adapters
    replay = PiecewiseGraphs.run

    def recording(self, ids, positions, meta, logits_indices, loras=None, lora_rows=None):
        if lora_rows:
            adapted_pieces.append((len(ids), meta.num_decodes, meta.prefills is not None))
        return replay(self, ids, positions, meta, logits_indices, loras, lora_rows)
    monkeypatch.setattr(PiecewiseGraphs, "run", recording)

    def run(engine):
        for name in ("r4", "r8"):
            engine.add_lora(name, tmp_path / name)
        outputs = run_staggered(engine, prompts, params, [i // 2 for i in range(len(prompts))], adapters)
        return [(out.outputs[0].token_ids, out.outputs[0].logprobs) for out in outputs]

    def reference(adapter, dtype):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=dtype)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, tmp_path / adapter)
        return model.cuda().eval()

    for (tokens, _), prompt, adapter in zip(run(_engine(tiny_llama_dir, "float32")), prompts, adapters):
        assert tokens == hf_greedy(reference(adapter, torch.float32), prompt, 16)
    assert any(rows > 256 for rows, _, _ in adapted_pieces)  # the larger blocks' bucket
    assert any(decodes and prefills for _, decodes, prefills in adapted_pieces)  # prompts beside decodes

    graphed = _engine(tiny_llama_dir, "bfloat16")
    assert graphed.runner.shard.graphs.with_lora and graphed.runner.shard.piecewise.with_lora
    # Graphs pad the LoRA work items to a fixed count, which changes the shrink's K split and so the
    # bf16 summation order against the eager engine: logprobs agree within bf16 rounding, not bit for bit.
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(
            run(graphed), run(_engine(tiny_llama_dir, "bfloat16", cuda_graphs=False))):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 0.05


@pytest.mark.parametrize("variant", ["gemma2", "qwen3-qk-norm"])
def test_lora_beside_the_matmuls_equals_eager_in_float32(tmp_path, monkeypatch, variant):
    """Families where not every adapted output reaches a kernel that adds its delta: Gemma 2 (GELU,
    post-norms after o and down) and Qwen3 (q/k norms before the rotation). In graphs, where adapters
    run beside the matmuls (lora.SlotBatch.beside), the same greedy tokens as the engine stepping
    eagerly with the adapter kernels in place, with base and adapted requests in one batch."""
    from peft import LoraConfig, get_peft_model

    from app.engine.lora import BESIDE_MAX_ROWS, SlotBatch
    from tests.conftest import run_staggered
    from tests.engine.test_models import _save_tiny

    model = _save_tiny(tmp_path / "model", variant)
    torch.manual_seed(5)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapted = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False))
    for module in adapted.modules():
        if hasattr(module, "lora_B"):
            for b in module.lora_B.values():
                torch.nn.init.normal_(b.weight, std=0.5)
    adapted.save_pretrained(tmp_path / "adapter")
    prompts = random_prompts(6, 10, 60, 200, seed=11)
    adapters = ["a", None, "a", "a", None, "a"]
    captured = []  # modules whose graphs run the adapter beside the matmul
    beside = SlotBatch.beside

    def counting(self, x, key, width):
        captured.append(key)
        return beside(self, x, key, width)
    monkeypatch.setattr(SlotBatch, "beside", counting)

    def run(cuda_graphs: bool):
        engine = _engine(tmp_path / "model", "float32", cuda_graphs=cuda_graphs)
        engine.add_lora("a", tmp_path / "adapter")
        if cuda_graphs:
            assert engine.runner.shard.graphs.with_lora and engine.runner.shard.graphs.max_batch_size > len(prompts)
        outputs = run_staggered(engine, prompts, SamplingParams(max_tokens=24, temperature=0.0), [0, 0, 1, 2, 2, 3],
                                adapters)
        return [out.outputs[0].token_ids for out in outputs]

    assert len(prompts) <= BESIDE_MAX_ROWS  # every decode step beside
    assert run(True) == run(False)
    assert {path for _, path in captured} == {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                              "mlp.down_proj"} - ({"mlp.gate_up_proj"} if variant == "gemma2" else
                                                                  {"self_attn.qkv_proj"})


def test_speculative_greedy_equals_plain_decoding_in_float32_with_cuda_graphs(tiny_llama_dir):
    """Guesses ride in decode graphs as rows of their own (four sequences of up to five rows each),
    between overlapped steps: the greedy tokens are plain decoding's. A random model repeats itself
    too rarely to guess right, so the proposer here knows the answer and spoils its last guess: every
    guessing step confirms some rows and rejects one."""
    from tests.engine.test_speculative import spoiled_answers

    prompts = random_prompts(4, 5, 12, 256, seed=11)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    plain = _engine(tiny_llama_dir, "float32").generate(prompts, params)
    engine = _engine(tiny_llama_dir, "float32", speculative_config={"max_draft_len": 4, "max_matching_ngram_size": 3})
    assert engine.runner.shard.graphs is not None and engine.overlap
    engine.proposer.propose = spoiled_answers(prompts, plain)
    guessed = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in guessed] == [o.outputs[0].token_ids for o in plain]
    drafted = sum(o.metrics.total_draft_tokens for o in guessed)
    assert 0 < sum(o.metrics.total_accepted_draft_tokens for o in guessed) < drafted


def test_draft_model_greedy_equals_plain_decoding_in_float32_with_cuda_graphs(tiny_llama_dir, tmp_path):
    """A draft model (the target with noise on its weights) decodes its guesses from its own decode
    graphs over a pool that mirrors the target's; the target checks them in its graphs, overlapped
    between guessing steps: plain decoding's tokens, and each proposal the draft's own greedy tokens."""
    from tests.engine.test_draft_model import assert_draft_model_greedy, draft_config, noisy_copy, record_proposals

    draft_dir = noisy_copy(tiny_llama_dir, tmp_path / "draft", 0.3)
    prompts = random_prompts(4, 5, 30, 256, seed=3)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    plain = _engine(tiny_llama_dir, "float32").generate(prompts, params)
    engine = _engine(tiny_llama_dir, "float32", speculative_config=draft_config(draft_dir))
    assert engine.proposer.shard.graphs is not None and engine.overlap
    assert engine.proposer.shard.num_blocks == engine.runner.num_blocks
    proposals = record_proposals(engine)
    guessed = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in guessed] == [o.outputs[0].token_ids for o in plain]
    drafted = sum(o.metrics.total_draft_tokens for o in guessed)
    assert 0 < sum(o.metrics.total_accepted_draft_tokens for o in guessed) < drafted
    assert_draft_model_greedy(draft_dir, proposals)


def _shuffled_tables(lens: list[int], block: int, g: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """Block tables (int32, zero-padded) for contexts of `lens` tokens over blocks of `block`, the
    blocks in shuffled order; and each sequence's block count."""
    counts = [-(-n // block) for n in lens]
    order = torch.randperm(sum(counts), generator=g).tolist()
    tables = torch.zeros(len(lens), max(counts), dtype=torch.int32)
    for i, n in enumerate(counts):
        tables[i, :n] = torch.tensor(order[sum(counts[:i]):sum(counts[:i]) + n])
    return tables, counts


def _dense_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, n: int,
                  scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """One sequence's decode attention, dense: q [H, D] over the first n keys of its `blocks` (the last
    `window` of them where one is set), each KV head repeated for its query heads."""
    keys, values = (c[blocks.long()].flatten(0, 1)[:n][-(window or n):].repeat_interleave(q.shape[0] // c.shape[2], 1)
                    for c in (k_cache, v_cache))
    scores = torch.einsum("hd,nhd->hn", q, keys) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), values)


def test_paged_decode_kernel_windows_and_softcaps_against_a_dense_reference(monkeypatch):
    """The Triton decode kernel with sliding windows (one key; within a tile; a window starting mid-tile,
    so whole 128-token tiles before it are skipped; wider than the context) and a softcap, over 16-token
    blocks in shuffled order, against dense float32 attention; in the launch shapes of few programs and
    of many (the threshold moved so that these 16 programs take either)."""
    from app.engine.models import triton_attention

    g = torch.Generator().manual_seed(0)
    lens, block, kv_heads, heads = [1, 15, 16, 127, 128, 129, 300, 515], 16, 2, 8
    tables, counts = _shuffled_tables(lens, block, g)
    for head_dim in (64, 96, 256):  # 96 (Phi-3-mini): padded to the kernel's power-of-2 tile
        k_cache, v_cache = (torch.randn(sum(counts), block, kv_heads, head_dim, generator=g).cuda() for _ in "kv")
        q = torch.randn(len(lens), heads, head_dim, generator=g).cuda()
        for (window, softcap), many in itertools.product(
                [(None, None), (1, None), (16, None), (100, 4.0), (129, None), (1000, None), (None, 4.0)],
                (False, True)):
            monkeypatch.setattr(triton_attention, "MANY_PROGRAMS", 1 if many else 1 << 30)
            out = triton_attention.paged_decode(q, k_cache, v_cache, tables.cuda(),
                                                torch.tensor(lens, dtype=torch.int32).cuda(), 0.125, window, softcap)
            for i, n in enumerate(lens):
                expected = _dense_decode(q[i], k_cache, v_cache, tables[i, :counts[i]], n, 0.125, window, softcap)
                assert torch.allclose(out[i], expected, atol=1e-4), (head_dim, window, softcap, n, many)


def test_windowed_varlen_prefill_against_chunk_by_chunk_prefill():
    """Flash attention's window_size=(window - 1, 0) sees what transformers' sliding window sees, over a
    cached prefix too: CudaKernels' one varlen call against the portable chunk-by-chunk SDPA, in bf16."""
    from app.engine.models.kernels import CudaKernels, TorchKernels
    from tests.engine.test_models import _prefill_step

    device = torch.device("cuda")
    flash = CudaKernels(device, torch.bfloat16)
    if flash.flash is None:
        pytest.skip("this torch has no varlen flash attention")
    q, k, v, k_cache, v_cache, meta, _ = _prefill_step(device="cuda", dtype=torch.bfloat16)
    for window in (None, 5, 16):
        expected = TorchKernels(device, torch.bfloat16).attention(q, k, v, k_cache, v_cache, meta, 0.25, window)
        got = flash.attention(q, k, v, k_cache, v_cache, meta, 0.25, window)
        assert (got.float() - expected.float()).abs().max() < 2e-2, window


# transformers 5.17 (the GPU image's) continues one 142-token Gemma 2 prompt differently from 5.24
# (requirements.txt), which agrees with our CPU and CUDA paths alike: run with 5.24 installed. On
# the device machine: carry the transformers 5.24 and tokenizers 0.23 wheels, `pip install --no-deps
# --target /tmp/tf` them and put /tmp/tf first on PYTHONPATH (it passed so on an H200, 2026-11-27).
OLD_TRANSFORMERS = pytest.mark.skipif(
    tuple(int(p) for p in __import__("transformers").__version__.split(".")[:2]) < (5, 24),
    reason="Gemma 2 reference needs transformers >= 5.24")


@pytest.mark.parametrize("variant", ["mistral-sliding-window", pytest.param("gemma2", marks=OLD_TRANSFORMERS)])
def test_sliding_window_and_softcaps_equal_transformers_in_float32(tmp_path, variant):
    """Windows (16 tokens) over contexts of up to 248: prefill in 64-token chunks over cached prefixes,
    a second round reusing the first's blocks, decode from CUDA graphs (the kernel skipping whole tiles);
    Gemma 2 with softcaps and head_dim 256 (the fused rotary kernel)."""
    from tests.engine.test_models import _save_tiny

    hf = _save_tiny(tmp_path, variant).cuda()
    prompts = random_prompts(4, 100, 170, 200, seed=8)
    extended = [p + q for p, q in zip(prompts, random_prompts(4, 10, 30, 200, seed=9))]
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", max_num_tokens=64,
                                    kv_cache_config={"max_tokens": 8192, "tokens_per_block": 16}))
    params = SamplingParams(max_tokens=48, temperature=0.0)
    outs = engine.generate(prompts, params) + engine.generate(extended, params)
    assert all(out.metrics.kv_cache_reused_blocks > 0 for out in outs[len(prompts):])
    for prompt, out in zip(prompts + extended, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 48)


@pytest.mark.parametrize("variant", ["mistral-sliding-window", "gemma2"])
def test_sliding_window_and_softcaps_within_bfloat16_tolerance(tmp_path, variant):
    """In bf16 prefill chunks go through the varlen path: flash attention with a left window (Mistral),
    chunk by chunk for softcaps (Gemma 2). First tokens within bf16 rounding of transformers in float32."""
    from tests.engine.test_models import _save_tiny

    hf = _save_tiny(tmp_path, variant).cuda()
    prompts = random_prompts(6, 100, 200, 200, seed=10)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cuda", dtype="bfloat16", max_num_tokens=48,
                                    kv_cache_config={"max_tokens": 8192, "tokens_per_block": 16}))
    outs = engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, logprobs=True))
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            reference = torch.log_softmax(hf(torch.tensor([prompt], device="cuda")).logits[0, -1], -1)
        token = out.outputs[0].token_ids[0]
        assert abs(out.outputs[0].logprobs[0] - reference[token].item()) < 0.15
        assert reference[token] >= reference.max() - 0.15  # greedy up to bf16 ties


def _teacher_forced_agreement(engine, prompts, answers) -> float:
    """How often the engine's top choice is the answer's next token, each answer fed back whole."""
    agree = total = 0
    for prompt, answer in zip(prompts, answers):
        text = prompt + answer
        scored = engine.generate([text], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))[0]
        agree += sum(scored.prompt_top_logprobs[i][0][0] == text[i] for i in range(len(prompt), len(text)))
        total += len(answer)
    return agree / total


def test_fp8_linears_in_cuda_graphs_agree_with_bfloat16(tiny_llama_dir):
    """quantization: fp8 on the device (torch._scaled_mm, row-wise scales). The layer: within FP8's
    precision of the float matmul, as on CPU (tests/engine/test_fp8.py). The engine, decode steps
    replayed from CUDA graphs: teacher-forced over bf16's greedy answers, FP8's top choice is bf16's
    at >= 60% of positions. This random 2-layer model has small margins between its top choices (a
    median of 0.43 nats): its FP8 agreement measured 0.74 on the GPU and 0.73 in float32 on CPU."""
    from app.engine.models import triton_fp8
    from app.engine.models.layers import FP8, MergedLinear

    torch.manual_seed(0)
    layer = MergedLinear(256, [128, 64], bias=False, dtype=torch.bfloat16).cuda()
    layer.weight.normal_(0, 0.05)
    x = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16)
    expected = (x.float() @ layer.weight.float().T)
    layer.quantize_fp8()
    relative = (layer(x).float() - expected).norm(dim=1) / expected.norm(dim=1)
    assert relative.max() < 0.06, relative.max()

    prompts = random_prompts(8, 3, 40, 256, seed=9)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    bf16, fp8 = _engine(tiny_llama_dir, "bfloat16"), _engine(tiny_llama_dir, "bfloat16", quantization="fp8")
    assert fp8.runner.shard.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8
    assert fp8.runner.shard.model.layers[0].self_attn.qkv_proj.fp8_matmul is triton_fp8.fp8_linear
    assert fp8.runner.shard.graphs is not None
    answers = [out.outputs[0].token_ids for out in bf16.generate(prompts, greedy)]
    assert all(len(out.outputs[0].token_ids) == 24 for out in fp8.generate(prompts, greedy))  # through the graphs
    agreement = _teacher_forced_agreement(fp8, prompts, answers)
    assert agreement >= 0.6, agreement


@pytest.mark.parametrize("rows, outs, width, dtype, magnitude", [
    (1, 384, 512, torch.bfloat16, 1.0), (7, 20480, 1024, torch.bfloat16, 1.0), (16, 384, 4096, torch.bfloat16, 1.0),
    (4, 384, 1040, torch.bfloat16, 3e4), (4, 384, 1024, torch.bfloat16, 1e-3), (5, 384, 1024, torch.float16, 1.0),
    (3, 384, 8208, torch.bfloat16, 1.0), (24, 20480, 1040, torch.bfloat16, 1.0), (32, 384, 512, torch.bfloat16, 1.0),
    (33, 384, 512, torch.bfloat16, 1.0),
    (300, 384, 4096, torch.bfloat16, 1.0)])
def test_fp8_triton_linears_against_the_portable_path(rows, outs, width, dtype, magnitude, monkeypatch):
    """CudaKernels' FP8 linear: up to WEIGHT_ONLY_ROWS rows, FP8 weights widened to fp16 in the kernel
    with the activations, within the bf16 output's rounding of the float32 matmul (bf16 activations
    are prescaled: at 3e4 they would overflow fp16 without it, and at 1e-3 a larger prescale would
    lose their precision); a NaN stays in its row. K is split over programs for a narrow layer (384
    outputs: 4 splits, each several K blocks at width 4096; 8 at width 8208) and not for a wide one
    (20480), also with a width that is no multiple of the K block (1040, 8208). Past
    WEIGHT_ONLY_ROWS, one quantize kernel and _scaled_mm, whose quantized activations match the
    portable op-by-op ones."""
    from app.engine.models import triton_fp8
    from app.engine.models.kernels import FP8, fp8_linear
    from app.engine.models.triton_fp8 import WEIGHT_ONLY_ROWS, quantize_rows

    torch.manual_seed(rows)
    weight = torch.randn(outs, width, device="cuda") * width ** -0.5
    scale = weight.abs().amax(dim=1, keepdim=True) / torch.finfo(FP8).max
    weight8, weight_scale = (weight / scale).to(FP8), scale.t().contiguous()
    bias = torch.randn(outs, device="cuda", dtype=dtype) * magnitude
    x = (torch.randn(rows, width, device="cuda") * magnitude).to(dtype)
    expected = x.float() @ (weight8.float() * scale).T + bias.float()
    weight_only_calls, weight_only = [], triton_fp8.weight_only_matmul

    def counted(*args, **kwargs):
        weight_only_calls.append(args[0].shape[0])
        return weight_only(*args, **kwargs)
    monkeypatch.setattr(triton_fp8, "weight_only_matmul", counted)
    got = triton_fp8.fp8_linear(x, weight8, weight_scale, bias)
    assert got.dtype == dtype
    splits = triton_fp8.weight_only_launch(outs, width, x.device)["split_k"]
    assert splits == (1 if outs == 20480 else 8 if width == 8208 else 4), splits
    assert len(weight_only_calls) == (rows <= WEIGHT_ONLY_ROWS)
    relative = ((got.float() - expected).norm(dim=1) / expected.norm(dim=1)).max()
    assert relative < (0.004 if rows <= WEIGHT_ONLY_ROWS else 0.06), relative
    if rows <= WEIGHT_ONLY_ROWS:
        x_nan = x.clone()
        x_nan[0, 0] = float("nan")
        with_nan = triton_fp8.fp8_linear(x_nan, weight8, weight_scale, bias)
        assert with_nan[0].isnan().all() and not with_nan[1:].isnan().any()
    portable = fp8_linear(x, weight8, weight_scale, bias)
    assert ((portable.float() - expected).norm(dim=1) / expected.norm(dim=1)).max() < 0.06
    q, row_scale = quantize_rows(x)
    expected_scale = x.float().abs().amax(dim=1, keepdim=True) / torch.finfo(FP8).max
    torch.testing.assert_close(row_scale, expected_scale, rtol=1e-6, atol=0)
    same = (q.float() == (x.float() / expected_scale).to(FP8).float()).float().mean()
    assert same > 0.999, same  # a division rounded differently may move a tie


def test_fp8_kv_cache_triton_write_and_decode_against_the_bfloat16_cache(monkeypatch):
    """kv_cache_config.dtype fp8 on the device, with scales 0.5 and 2.0 (powers of two: dividing by
    them is exact however the kernel divides). The fused rotary + KV write stores the bf16 keys and
    values it computes divided by their scale in E4M3, byte for byte what the portable quantize makes
    of the bf16 cache's contents, and leaves k and v in qkv as the cache holds them (q untouched).
    The decode kernel over that cache, in the launch shapes of few programs and of many (the threshold
    moved so that these 16 programs take either), with and without a window and a softcap: within bf16
    rounding of dense float32 attention over the dequantized cache, and within FP8's precision of the
    kernel over the bf16 cache (per head, a relative error < 0.12; dense float32 attention over the same
    data gave at most 0.066 on CPU)."""
    from app.engine.models import triton_attention, triton_fused
    from app.engine.models.attention import FP8, dequantize, quantize
    from app.engine.models.layers import RotaryEmbedding

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block = 8, 2, 64, 16
    scales = (torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda"))
    t, num_blocks = 40, 4
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).bfloat16().cuda()
    cos, sin = RotaryEmbedding(head_dim, 512, 10000.0, None).cuda().table(torch.arange(t, device="cuda") + 7,
                                                                          torch.bfloat16)
    slots = torch.randperm(num_blocks * block, generator=g)[:t].cuda()
    caches = {}
    for dtype in (torch.bfloat16, FP8):
        k_cache, v_cache = (torch.zeros(num_blocks, block, kv_heads, head_dim, dtype=dtype, device="cuda")
                            for _ in "kv")
        out = triton_fused.rotary_store(qkv.clone(), heads, kv_heads, cos, sin, k_cache, v_cache, slots,
                                        scales if dtype == FP8 else None)
        caches[dtype] = (k_cache, v_cache, out)
    (k16, v16, (q_ref, _, _)), (k8, v8, (q, k, v)) = caches[torch.bfloat16], caches[FP8]
    assert torch.equal(q, q_ref)
    for cache8, cache16, scale, stored in ((k8, k16, scales[0], k), (v8, v16, scales[1], v)):
        assert torch.equal(cache8.view(torch.uint8), quantize(cache16, scale).view(torch.uint8))
        assert torch.equal(stored, dequantize(cache8, scale, torch.bfloat16).flatten(0, 1)[slots])

    lens = [1, 15, 16, 127, 128, 129, 300, 515]
    tables, counts = _shuffled_tables(lens, block, g)
    k16, v16 = (torch.randn(sum(counts), block, kv_heads, head_dim, generator=g).bfloat16().cuda() for _ in "kv")
    k8, v8 = quantize(k16, scales[0]), quantize(v16, scales[1])
    q = torch.randn(len(lens), heads, head_dim, generator=g).bfloat16().cuda()
    tables, context = tables.cuda(), torch.tensor(lens, dtype=torch.int32).cuda()
    keys, values = dequantize(k8, scales[0], torch.float32), dequantize(v8, scales[1], torch.float32)
    for (window, softcap), many in itertools.product([(None, None), (100, 4.0), (129, None)], (False, True)):
        monkeypatch.setattr(triton_attention, "MANY_PROGRAMS", 1 if many else 1 << 30)
        out8 = triton_attention.paged_decode(q, k8, v8, tables, context, 0.125, window, softcap,
                                             kv_scales=scales).float()
        out16 = triton_attention.paged_decode(q, k16, v16, tables, context, 0.125, window, softcap).float()
        for i, n in enumerate(lens):
            expected = _dense_decode(q[i].float(), keys, values, tables[i, :counts[i]], n, 0.125, window, softcap)
            assert (out8[i] - expected).abs().max() < 3e-2, (n, window, softcap, many)
            relative = (out8[i] - out16[i]).norm(dim=-1) / out16[i].norm(dim=-1)
            assert relative.max() < 0.12, (n, window, softcap, many, relative.max())


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8"])
def test_fused_kernels_add_a_lora_delta_as_the_projection_would(kv_dtype):
    """rotary_store, silu_mul and add_rms_norm given a projection's float32 LoRA delta (what a graph
    computes beside the matmul) equal, bit for bit, the same kernels over the projection's output
    after `output.add_(delta)`; v reaches qkv with its delta too, as attention over a prefill chunk
    reads it there."""
    from app.engine.models import triton_fused
    from app.engine.models.attention import FP8
    from app.engine.models.layers import RotaryEmbedding

    g = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, t, hidden = 8, 2, 64, 24, 512

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).cuda()

    qkv, qkv_delta = rand(t, (heads + 2 * kv_heads) * head_dim), rand(t, (heads + 2 * kv_heads) * head_dim,
                                                                      dtype=torch.float32) * 0.01
    cos, sin = RotaryEmbedding(head_dim, 512, 10000.0, None).cuda().table(torch.arange(t, device="cuda"),
                                                                          torch.bfloat16)
    slots = torch.randperm(64, generator=g)[:t].cuda()
    cache_dtype = FP8 if kv_dtype == "fp8" else torch.bfloat16
    scales = (torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")) if kv_dtype == "fp8" else None
    results = []
    for delta in (None, qkv_delta):
        caches = [torch.zeros(4, 16, kv_heads, head_dim, dtype=cache_dtype, device="cuda") for _ in "kv"]
        x = qkv.clone() if delta is not None else qkv.clone().add_(qkv_delta)
        out = triton_fused.rotary_store(x, heads, kv_heads, cos, sin, *caches, slots, scales, delta)
        results.append((x, [c.view(torch.uint8) for c in caches], out))
    (x_ref, caches_ref, out_ref), (x, caches, out) = results
    assert torch.equal(x, x_ref)
    assert all(torch.equal(a, b) for a, b in zip(caches, caches_ref))
    assert all(torch.equal(a, b) for a, b in zip(out, out_ref))

    gate_up, delta = rand(t, 2 * hidden), rand(t, 2 * hidden, dtype=torch.float32) * 0.01
    assert torch.equal(triton_fused.silu_mul(gate_up.clone(), delta),
                       triton_fused.silu_mul(gate_up.clone().add_(delta)))

    x, residual, weight = rand(t, hidden), rand(t, hidden), rand(hidden)
    delta = rand(t, hidden, dtype=torch.float32) * 0.01
    residual_ref = residual.clone()
    normed = triton_fused.add_rms_norm(x.clone(), residual, weight, 1e-6, delta)
    assert torch.equal(normed, triton_fused.add_rms_norm(x.clone().add_(delta), residual_ref, weight, 1e-6))
    assert torch.equal(residual, residual_ref)


def test_fp8_kv_cache_engine_in_cuda_graphs_agrees_with_bfloat16(tiny_llama_dir):
    """An FP8 cache under a bf16 model: prompts of 100-200 tokens prefilled 48 a step (the varlen
    kernel reading the cached prefix, dequantized) and decode steps replayed from CUDA graphs.
    Teacher-forced over the bf16 cache's greedy answers, FP8's top choice is bf16's at >= 65% of
    positions: this random 2-layer model has small margins between its top choices, and its FP8
    cache's agreement measured 0.82 in float32 on CPU (0.86 for prompts of 3-40 tokens)."""
    def engine(kv_dtype: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype="bfloat16", max_num_tokens=48,
                                      kv_cache_config={"max_tokens": 8192, "tokens_per_block": 16,
                                                       "dtype": kv_dtype}))
    prompts = random_prompts(6, 100, 200, 256, seed=6)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    bf16, fp8 = engine("auto"), engine("fp8")
    assert fp8.runner.shard.kv_cache.dtype == torch.float8_e4m3fn and fp8.runner.shard.graphs is not None
    answers = [out.outputs[0].token_ids for out in bf16.generate(prompts, greedy)]
    assert all(len(out.outputs[0].token_ids) == 24 for out in fp8.generate(prompts, greedy))  # through the graphs
    agreement = _teacher_forced_agreement(fp8, prompts, answers)
    assert agreement >= 0.65, agreement
