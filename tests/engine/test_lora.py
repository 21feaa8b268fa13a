"""Many LoRA adapters in one batch, exact against transformers + peft, under eviction too."""
import pytest
import torch

from app.engine import InvalidRequestError, SamplingParams
from tests.conftest import make_engine, random_prompts

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
    from app.engine.llm_engine import merge_outputs
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
    import json

    import numpy as np
    from safetensors.torch import load_file

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
