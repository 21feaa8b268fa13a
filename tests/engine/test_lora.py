"""Many LoRA adapters in one batch, exact against transformers + peft, under eviction too; bad
adapters refused whole when they are registered."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from app.engine import InvalidRequestError, SamplingParams
from app.engine.lora_loader import load_peft_adapter
from tests.conftest import hf_greedy, make_engine, random_prompts, stream_tokens

ADAPTERS = {  # name -> (seed, rank, targets)
    "a": (1, 4, ["q_proj", "v_proj"]),
    "b": (2, 8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "c": (3, 2, ["gate_proj", "up_proj", "down_proj"]),
    "d": (4, 6, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "e": (5, 4, ["o_proj", "down_proj"]),
}
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory):
    """PEFT adapters with random (non-zero) B, saved in PEFT's own format."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dirs = {}
    for name, (seed, rank, targets) in ADAPTERS.items():
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                init_lora_weights=False))
        for module in model.modules():  # wide enough to change greedy choices
            if hasattr(module, "lora_B"):
                for b in module.lora_B.values():
                    torch.nn.init.normal_(b.weight, std=0.5)
        dirs[name] = tmp_path_factory.mktemp(f"lora-{name}")
        model.save_pretrained(dirs[name])
    return dirs


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, adapter_dirs):
    """transformers + peft greedy output for every (prompt, adapter) pair."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(3, 6, 30, vocab=256, seed=9)
    out = {}
    for name in [None, *ADAPTERS]:
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapter_dirs[name])
        model.eval()
        for i, prompt in enumerate(prompts):
            with torch.inference_mode():
                ids = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                     pad_token_id=1)[0, len(prompt):].tolist()
            out[(i, name)] = ids[:-1] if ids and ids[-1] == 1 else ids
    return prompts, out


def _run(engine, prompts, pairs, arrivals):
    batch_prompts = [prompts[i] for i, _ in pairs]
    merged = {}
    from app.engine.outputs import merge_outputs
    pending, step = set(range(len(pairs))), 0
    while pending or engine.has_unfinished_requests():
        for k in sorted(pending):
            if arrivals[k] <= step:
                engine.add_request(f"q{k}", batch_prompts[k], GREEDY, adapter_id=pairs[k][1])
                pending.discard(k)
        for o in engine.step():
            merged[o.request_id] = merge_outputs(merged.get(o.request_id), o)
        step += 1
    return [merged[f"q{k}"].outputs[0].token_ids for k in range(len(pairs))]


def test_adapters_change_outputs(expected):
    _, out = expected
    assert all(out[(0, name)] != out[(0, None)] for name in ADAPTERS)


def test_mixed_batch_matches_peft(tiny_llama_dir, adapter_dirs, expected):
    prompts, out = expected
    engine = make_engine(tiny_llama_dir, max_loras=8)
    for name, path in adapter_dirs.items():
        engine.add_lora(name, path)
    pairs = [(0, "a"), (1, "b"), (2, None), (0, "c"), (1, "d"), (2, "a"), (0, None)]
    got = _run(engine, prompts, pairs, [0, 0, 0, 1, 2, 4, 5])
    assert got == [out[p] for p in pairs]


def test_eviction_and_reload_keep_outputs_exact(tiny_llama_dir, adapter_dirs, expected):
    prompts, out = expected
    engine = make_engine(tiny_llama_dir, max_loras=2)
    for name, path in adapter_dirs.items():
        engine.add_lora(name, path)
    pairs = [(i % 3, name) for i, name in enumerate(["a", "b", "c", "d", "e", "a", "c", "e", None, "b"])]
    got = _run(engine, prompts, pairs, list(range(len(pairs))))
    assert got == [out[p] for p in pairs]
    cache = engine.runner.loras
    assert cache.evictions > 0 and cache.loads > len(ADAPTERS) - 1 and len(cache.on_device) <= 2


def test_adapter_id_is_part_of_the_block_hash(tiny_llama_dir, adapter_dirs):
    engine = make_engine(tiny_llama_dir, tokens_per_block=4)
    engine.add_lora("a", adapter_dirs["a"])
    prompt = random_prompts(1, 20, 20, vocab=256, seed=4)[0]
    engine.generate([prompt], GREEDY)
    engine.add_request("x", prompt, GREEDY, adapter_id="a")
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].metrics.kv_cache_reused_blocks == 0


def test_a_name_registered_again_never_reuses_the_old_weights_kv(tiny_llama_dir, adapter_dirs, expected):
    """Blocks cached under an adapter's name were reused after the name was registered again with
    other weights (the same path, its files replaced): the answer was the old adapter's, in part."""
    prompts, out = expected
    i = max(range(len(prompts)), key=lambda k: len(prompts[k]))  # the most full blocks to reuse
    engine = make_engine(tiny_llama_dir, tokens_per_block=4)
    engine.add_lora("x", adapter_dirs["a"])
    assert _run(engine, prompts, [(i, "x")], [0]) == [out[(i, "a")]]
    engine.add_lora("x", adapter_dirs["b"])
    reused = engine.stats().reused_blocks_total
    assert _run(engine, prompts, [(i, "x")], [0]) == [out[(i, "b")]]
    assert engine.stats().reused_blocks_total == reused
    assert _run(engine, prompts, [(i, "x")], [0]) == [out[(i, "b")]]
    assert engine.stats().reused_blocks_total > reused  # the new weights' own blocks are reused


def test_the_host_cache_evicts_the_least_recently_used(tiny_llama_dir, adapter_dirs, expected, monkeypatch):
    """Used since b was registered, a stays and b goes when c comes (the order was registration's
    alone: the adapter in use most was the first to go)."""
    monkeypatch.setattr("app.engine.llm_engine.FRESH_LOAD_S", 0.0)  # b's request never comes
    prompts, out = expected
    engine = make_engine(tiny_llama_dir, max_cpu_loras=2, max_loras=2)
    engine.add_lora("a", adapter_dirs["a"])
    engine.add_lora("b", adapter_dirs["b"])
    assert _run(engine, prompts, [(0, "a")], [0]) == [out[(0, "a")]]
    engine.add_lora("c", adapter_dirs["c"])
    assert list(engine.runner.loras.host) == ["a", "c"]


def test_unknown_adapter_and_bad_paths_are_refused(tiny_llama_dir, tmp_path):
    engine = make_engine(tiny_llama_dir)
    with pytest.raises(InvalidRequestError, match="not loaded"):
        engine.add_request("x", [5, 6, 7], GREEDY, adapter_id="nope")
    with pytest.raises(InvalidRequestError, match="adapter_config.json"):
        engine.add_lora("empty", tmp_path)


def _write_trtllm_format(peft_dir, out_dir):
    """The layout the seeds' hf_lora_convert.py writes (float32 storage): per module a row of
    A [r, in] then B * alpha / r [out, r], flattened and zero-padded; config rows of
    [module_id, layer, r] with TensorRT-LLM's module ids."""
    ids = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6, "up_proj": 7}
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(peft_dir / "adapter_model.safetensors")
    rows, meta = [], []
    for key in sorted(k for k in tensors if k.endswith("lora_A.weight")):
        parts = key.split(".")
        layer, module = int(parts[parts.index("layers") + 1]), parts[-3]
        a, b = tensors[key], tensors[key.replace("lora_A", "lora_B")] * scale
        rows.append(torch.cat([a.flatten(), b.flatten()]))
        meta.append([ids[module], layer, a.shape[0]])
    width = max(r.numel() for r in rows)
    weights = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])[None]
    out_dir.mkdir()
    np.save(out_dir / "model.lora_weights.npy", weights.numpy())
    np.save(out_dir / "model.lora_config.npy", np.array([meta], dtype=np.int32))


def test_trtllm_converted_format_matches_its_peft_original(tiny_llama_dir, adapter_dirs, expected, tmp_path):
    prompts, out = expected
    _write_trtllm_format(adapter_dirs["d"], tmp_path / "d-trt")
    engine = make_engine(tiny_llama_dir)
    engine.add_lora("d-trt", tmp_path / "d-trt")
    pairs = [(0, "d-trt"), (1, "d-trt"), (2, None)]
    got = _run(engine, prompts, pairs, [0, 0, 0])
    assert got == [out[(0, "d")], out[(1, "d")], out[(2, None)]]


# Spoilers: each writes to `bad` a copy of the adapter at `good` with one thing wrong.
def _edit_config(**changes):
    def spoil(good, bad):
        shutil.copytree(good, bad)
        config = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return spoil


def _edit_tensors(edit):
    def spoil(good, bad):
        shutil.copytree(good, bad)
        save_file(edit(load_file(bad / "adapter_model.safetensors")), bad / "adapter_model.safetensors")
    return spoil


def _replace_file(file, content: bytes | None = None, cut: int = 0):
    def spoil(good, bad):
        shutil.copytree(good, bad)
        data = (bad / file).read_bytes()
        (bad / file).write_bytes(content if content is not None else data[:-cut])
    return spoil


def _edit_npy(edit):
    def spoil(good, bad):
        _write_trtllm_format(good, bad)
        arrays = [np.load(bad / file) for file in ("model.lora_weights.npy", "model.lora_config.npy")]
        weights, config = edit(*arrays)
        np.save(bad / "model.lora_weights.npy", weights)
        np.save(bad / "model.lora_config.npy", config)
    return spoil


def _set_layer(config, layer):
    config = config.copy()
    config[0, 0, 1] = layer
    return config


V0_B = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
Q0_B = V0_B.replace("v_proj", "q_proj")
BAD_ADAPTERS = {  # spoiled copies of adapter "a" (rank 4; q_proj, v_proj; the model: 2 layers, 64 wide, kv 32)
    "rank_mismatch": (_edit_config(r=2),
                      "lora_path", r"lora_A of layers\.0 q_proj is \[4, 64\] but rank 2 needs \[2, 64\]"),
    "layer_out_of_range": (_edit_tensors(lambda t: {k.replace("layers.1.", "layers.999."): v for k, v in t.items()}),
                           "lora_path", "is for layer 999 but the model has 2 layers"),
    "missing_b": (_edit_tensors(lambda t: {k: v for k, v in t.items() if k != V0_B}),
                  "lora_path", r"layers\.0 v_proj has lora_A but no lora_B"),
    "shape_of_another_module": (_edit_tensors(lambda t: {**t, V0_B: t[Q0_B].clone()}),
                                "lora_path", r"lora_B of layers\.0 v_proj is \[64, 4\] but rank 4 needs \[32, 4\]"),
    "not_finite": (_edit_tensors(lambda t: {**t, V0_B: torch.full_like(t[V0_B], float("nan"))}),
                   "lora_path", "not finite"),
    "integer_weights": (_edit_tensors(lambda t: {**t, V0_B: t[V0_B].int()}), "lora_path", "must be floating point"),
    "config_not_json": (_replace_file("adapter_config.json", b"{'r': 4"), "lora_path", "is not valid JSON"),
    "config_not_an_object": (_replace_file("adapter_config.json", b"[4]"), "lora_path", "JSON object, not a list"),
    "rank_is_a_string": (_edit_config(r="4"), "lora_path", "'r' must be an integer, not a string"),
    "rank_too_large": (_edit_config(r=65), "lora_path", r"must be in \[1, max_lora_rank=64\], not 65"),
    "dora": (_edit_config(use_dora=True), "lora_path", "uses use_dora"),
    "truncated_weights": (_replace_file("adapter_model.safetensors", cut=100),
                          "lora_path", "adapter_model.safetensors is unreadable or corrupt"),
    "untargeted_tensor": (_edit_config(target_modules=["q_proj"]), "lora_path", "v_proj, which .* does not name"),
    "target_without_tensors": (_edit_config(target_modules=["q_proj", "v_proj", "k_proj"]),
                               "lora_path", "targets k_proj but"),
    "npy_rows_too_short": (_edit_npy(lambda w, c: (w[..., :256], c)),
                           "lora_config", r"row 0 \(layers\.0 q_proj\) holds 256 values but rank 4 needs 512"),
    "npy_layer_out_of_range": (_edit_npy(lambda w, c: (w, _set_layer(c, 999))),
                               "lora_config", "row 0 is for layer 999 but the model has 2 layers"),
    "npy_pickled": (_edit_npy(lambda w, c: (np.array([{"x": 1}], dtype=object), c)),
                    "lora_config", r"model\.lora_weights\.npy is unreadable or corrupt"),
}
SERVED = [(0, "a"), (1, None), (2, "a")]


@pytest.fixture(scope="module")
def engine_with_a(tiny_llama_dir, adapter_dirs, expected):
    prompts, out = expected
    engine = make_engine(tiny_llama_dir)
    engine.add_lora("a", adapter_dirs["a"])
    assert _run(engine, prompts, SERVED, [0, 0, 0]) == [out[p] for p in SERVED]
    return engine


@pytest.mark.parametrize("case", BAD_ADAPTERS)
def test_a_bad_adapter_is_refused_whole(engine_with_a, adapter_dirs, tmp_path, case):
    """Registering a bad adapter under a served name fails with the adapter and its problem named,
    never a path, and leaves the adapter it would have replaced in place."""
    spoil, field, problem = BAD_ADAPTERS[case]
    spoil(adapter_dirs["a"], tmp_path / "bad")
    held = engine_with_a.runner.loras.host["a"]
    with pytest.raises(InvalidRequestError, match=problem) as refused:
        engine_with_a.add_lora("a", tmp_path / "bad")
    assert refused.value.field == field and refused.value.message.startswith("adapter 'a': ")
    assert "/" not in str(refused.value)
    assert engine_with_a.runner.loras.host["a"] is held


# What check_adapter_files cannot see: the model's layers and widths, the weights' values, and the
# TensorRT-LLM format's arrays.
NEEDS_MODEL_OR_WEIGHTS = {"layer_out_of_range", "shape_of_another_module", "not_finite", "npy_rows_too_short",
                          "npy_layer_out_of_range", "npy_pickled"}


@pytest.mark.parametrize("case", BAD_ADAPTERS)
def test_the_check_before_a_name_is_bound_refuses_what_it_can_see(adapter_dirs, tmp_path, case):
    """The Engine stage checks an adapter's files before it binds a name to them for every replica
    (the binding is never given back): whatever is wrong in the files themselves is refused there,
    with the message the full load gives (less the model's widths)."""
    from app.engine.lora_loader import check_adapter_files

    spoil, field, problem = BAD_ADAPTERS[case]
    if case == "rank_mismatch":  # without the model its widths are not known
        problem = r"lora_A of layers\.0 q_proj is \[4, 64\] but rank 2 needs \[2, any\]"
    spoil(adapter_dirs["a"], tmp_path / "bad")
    if case in NEEDS_MODEL_OR_WEIGHTS:
        check_adapter_files("a", tmp_path / "bad", 64, "lora_path")
        return
    with pytest.raises(InvalidRequestError, match=problem) as refused:
        check_adapter_files("a", tmp_path / "bad", 64, "lora_path")
    assert refused.value.field == field and refused.value.message.startswith("adapter 'a': ")


def test_the_check_before_a_name_is_bound_passes_good_adapters_and_refuses_empty_directories(adapter_dirs, tmp_path):
    from app.engine.lora_loader import check_adapter_files

    for name, path in adapter_dirs.items():
        check_adapter_files(name, path, 64, "lora_path")
    with pytest.raises(InvalidRequestError, match="must hold adapter_config.json"):
        check_adapter_files("x", tmp_path, 64, "lora_path")


def test_refused_adapters_never_reach_a_step(engine_with_a, adapter_dirs, expected, tmp_path):
    """After every bad adapter, under the served name and under names of their own, the engine
    serves the same batch with the same tokens as before."""
    for case, (spoil, _, _) in BAD_ADAPTERS.items():
        spoil(adapter_dirs["a"], tmp_path / case)
        for name in ("a", case):
            with pytest.raises(InvalidRequestError):
                engine_with_a.add_lora(name, tmp_path / case)
            assert case not in engine_with_a.runner.loras
    prompts, out = expected
    assert _run(engine_with_a, prompts, SERVED, [0, 0, 0]) == [out[p] for p in SERVED]


def test_without_the_model_the_adapter_is_still_checked_against_itself(adapter_dirs, tmp_path):
    """The Triton backend reads PEFT adapters with no model at hand: rank and pairs are still checked."""
    _edit_config(r=2)(adapter_dirs["a"], tmp_path / "rank")
    with pytest.raises(InvalidRequestError, match=r"is \[4, 64\] but rank 2 needs \[2, any\]"):
        load_peft_adapter("a", tmp_path / "rank", max_rank=64)


def test_a_mixture_of_experts_takes_attention_adapters_and_refuses_mlp_ones(tmp_path):
    """Adapters reach the projections the model's layers have: a Mixtral's attention is adapted
    exactly as peft does it; an adapter for a dense MLP (trained on a Mistral of the same shape) is
    refused by name, since a mixture has no such projection."""
    import transformers
    from peft import LoraConfig, get_peft_model

    shape = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False, initializer_range=0.2,
                 eos_token_id=1)
    torch.manual_seed(5)
    mixtral = transformers.AutoModelForCausalLM.from_config(
        transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2)).eval()
    mixtral.save_pretrained(tmp_path / "mixtral")
    prompts = random_prompts(2, 5, 20, vocab=200, seed=4)
    base_answer = hf_greedy(mixtral, prompts[0], 16)
    adapted = get_peft_model(mixtral, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                                                 init_lora_weights=False))
    for module in adapted.modules():
        if hasattr(module, "lora_B"):
            for b in module.lora_B.values():
                torch.nn.init.normal_(b.weight, std=0.5)
    adapted.save_pretrained(tmp_path / "attention")
    dense = transformers.AutoModelForCausalLM.from_config(transformers.MistralConfig(**shape))
    get_peft_model(dense, LoraConfig(r=4, target_modules=["gate_proj"])).save_pretrained(tmp_path / "mlp")

    engine = make_engine(tmp_path / "mixtral")
    engine.add_lora("attention", tmp_path / "attention")
    outputs = _run(engine, prompts, [(0, "attention"), (1, "attention"), (0, None)], [0, 0, 0])
    assert outputs == [hf_greedy(adapted.eval(), p, 16) for p in prompts] + [base_answer]
    with pytest.raises(InvalidRequestError, match="gate_proj: this model's adapters reach q_proj, k_proj, v_proj, "
                                                  "o_proj only"):
        engine.add_lora("mlp", tmp_path / "mlp")



@pytest.mark.parametrize("max_batch_size", [1, 16, 256, 272, 512])
def test_the_decode_graphs_lora_buffer_fits_every_bucket(max_batch_size):
    """The CUDA graphs' static work-item buffer holds the items of any step in any bucket, the worst
    case being every slot with a ragged share of the rows (planned on the host, as on CUDA)."""
    from app.engine.cuda_graphs import bucket_sizes, lora_item_capacity
    from app.engine.lora import LoRASlots, max_work_items

    slots = LoRASlots.__new__(LoRASlots)  # the planning half only: no device buffers
    slots.num_slots = 8
    sizes = bucket_sizes(max_batch_size)
    capacity = lora_item_capacity(sizes, 8)
    for size in sizes:
        worst = [1 + row % 8 for row in range(size)]  # every row adapted, spread over all slots
        items = slots.batch(worst, torch.device("cpu"), max_work_items(size, 8)).items
        assert len(items) == max_work_items(size, 8) <= capacity


def _held_front(tiny_llama_dir):
    """An AsyncLLMEngine whose adapter preparation waits for `release`, noting the thread it ran on."""
    import threading

    from app.engine import AsyncLLMEngine, EngineConfig

    front = AsyncLLMEngine(EngineConfig(), engine=make_engine(tiny_llama_dir))
    release, preparing = threading.Event(), []
    prepare = front.engine.prepare_lora

    def held_prepare(name, path):
        preparing.append(threading.current_thread())
        assert release.wait(60)
        return prepare(name, path)
    front.engine.prepare_lora = held_prepare
    return front, release, preparing


def test_an_adapter_is_prepared_off_the_loop_while_streams_run(tiny_llama_dir, adapter_dirs, expected):
    """Reading, checking and folding an adapter runs on the async engine's loader thread: a stream
    steps to its end while that preparation is held, then the adapter serves what peft generates."""
    import asyncio
    import threading

    prompts, out = expected
    front, release, preparing = _held_front(tiny_llama_dir)

    async def main():
        adding = asyncio.create_task(front.add_lora("a", str(adapter_dirs["a"])))
        while not preparing:
            await asyncio.sleep(0.01)
        base = await stream_tokens(front, "base", prompts[0], GREEDY)
        assert not adding.done()  # the whole stream ran while the adapter was being prepared
        release.set()
        await adding
        return base, await stream_tokens(front, "adapted", prompts[0], GREEDY, "a")

    try:
        assert asyncio.run(main()) == (out[(0, None)], out[(0, "a")])
        assert preparing[0] not in (threading.main_thread(), front._thread)
        assert front.has_lora("a")
    finally:
        front.shutdown()


def test_adapters_loading_when_the_engine_shuts_down_fail_their_callers(tiny_llama_dir, adapter_dirs):
    """One being prepared and one queued behind it: both callers get EngineDeadError, neither waits."""
    import asyncio

    from app.engine import EngineDeadError

    front, release, preparing = _held_front(tiny_llama_dir)

    async def main():
        loads = [asyncio.create_task(front.add_lora(name, str(adapter_dirs[name]))) for name in ("a", "b")]
        while not preparing:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(front.shutdown)
        release.set()
        return await asyncio.wait_for(asyncio.gather(*loads, return_exceptions=True), 30)

    errors = asyncio.run(main())
    assert all(isinstance(e, EngineDeadError) and "shut down" in str(e) for e in errors), errors
