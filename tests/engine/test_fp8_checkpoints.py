"""FP8 checkpoints load as they are stored: ModelOpt's (quant_algo FP8: one scale per tensor, static
input scales, hf_quant_config.json beside config.json) and compressed-tensors' (float-quantized,
strategy channel: one scale per output channel, dynamic per-token activations). Each is written here
from the embedded SmolLM2 the way those tools lay it out (tensor names, shapes, quantization_config;
the lm_head is tied and ignored), with FP8 KV-cache scales that the loader skips."""
import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.engine import SamplingParams
from app.engine.model_loader import load_model
from app.engine.models.kernels import FP8_MAX
from app.engine.models.layers import FP8, MergedLinear
from app.engine.parallel import ParallelLayout, TensorParallel
from app.text import Tokenizer
from tests.conftest import make_engine

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# our merged linear -> (its HF projections, whether tensor parallelism slices its outputs (column) or inputs)
MERGED = {"self_attn.qkv_proj": (("q_proj", "k_proj", "v_proj"), True), "self_attn.o_proj": (("o_proj",), False),
          "mlp.gate_up_proj": (("gate_proj", "up_proj"), True), "mlp.down_proj": (("down_proj",), False)}
FP8_ARGS = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None,
            "actorder": None, "observer_kwargs": {}}
MODELOPT_QUANTIZATION = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
PRODUCER = {"name": "modelopt", "version": "0.29.0"}
# config.json's quantization_config as each tool writes it (ModelOpt converts its hf_quant_config.json).
QUANTIZATION_CONFIGS = {
    "modelopt": {"config_groups": {"group_0": {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                                               "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
                                               "targets": ["Linear"]}},
                 "ignore": ["lm_head"], "quant_algo": "FP8",
                 "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
                 "producer": PRODUCER, "quant_method": "modelopt"},
    "compressed-tensors": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "global_compression_ratio": None, "ignore": ["lm_head"], "sparsity_config": {}, "transform_config": {},
        "kv_cache_scheme": {**FP8_ARGS, "strategy": "tensor", "dynamic": False, "observer": "minmax"},
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "float-quantized", "output_activations": None,
            "weights": {**FP8_ARGS, "strategy": "channel", "dynamic": False, "observer": "minmax"},
            "input_activations": {**FP8_ARGS, "strategy": "token", "dynamic": True, "observer": None}}}},
}


def write_fp8_checkpoint(source, out, method: str) -> dict[str, torch.Tensor]:
    """`source` with its decoder linears in E4M3: ModelOpt with a [] float32 scale per tensor (and
    static input_scale, k_proj.k_scale, v_proj.v_scale), compressed-tensors with [out, 1] scales per
    channel (and self_attn.k_scale, v_scale). Returns every tensor written."""
    shutil.copytree(source, out)
    tensors = load_file(out / "model.safetensors")
    per_channel = method == "compressed-tensors"
    for name in [name for name in tensors if name.split(".")[-2] in PROJECTIONS]:
        weight = tensors[name]
        amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax()
        scale = amax.clamp(min=1e-12) / FP8_MAX
        tensors[name], tensors[name + "_scale"] = (weight / scale).to(FP8), scale
        if not per_channel:
            tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.02)
    for layer in {name.split(".")[2] for name in tensors if ".layers." in name}:
        for kv in "kv":
            prefix = f"model.layers.{layer}.self_attn."
            key = prefix + (f"{kv}_proj.{kv}_scale" if method == "modelopt" else f"{kv}_scale")
            tensors[key] = torch.tensor(0.1) if method == "modelopt" else torch.tensor([0.1])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIGS[method]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if method == "modelopt":
        (out / "hf_quant_config.json").write_text(json.dumps({"producer": PRODUCER,
                                                               "quantization": MODELOPT_QUANTIZATION}))
    return tensors


@pytest.fixture(scope="module", params=["modelopt", "compressed-tensors"])
def fp8_checkpoint(request, smollm2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / request.param
    return request.param, out, write_fp8_checkpoint(smollm2_dir, out, request.param)


def _expected(tensors, layer: int, path: str, tp: int = 1, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 weight (as bytes) and [1, out] scales that merged linear `path` of `layer` holds on `rank`."""
    projections, column = MERGED[path]
    weights, scales = [], []
    for projection in projections:
        prefix = f"model.layers.{layer}.{path.split('.')[0]}.{projection}"
        weight = tensors[prefix + ".weight"]
        scale = tensors[prefix + ".weight_scale"].reshape(-1).expand(weight.shape[0])
        if column:
            weight, scale = weight.chunk(tp)[rank], scale.chunk(tp)[rank]
        else:
            weight = weight.chunk(tp, dim=1)[rank]
        weights.append(weight)
        scales.append(scale)
    return torch.cat(weights).view(torch.uint8), torch.cat(scales)[None]


def _check_weights(model, tensors, tp: int = 1, rank: int = 0) -> None:
    for layer in range(model.config.num_layers):
        for path in MERGED:
            module = model.layers[layer].get_submodule(path)
            weight, scale = _expected(tensors, layer, path, tp, rank)
            assert module.weight.dtype == FP8 and torch.equal(module.weight.view(torch.uint8), weight), (layer, path)
            assert torch.equal(module.weight_scale, scale), (layer, path)
    assert torch.equal(model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    assert model.lm_head.weight.dtype == torch.float32  # tied to the embedding, and ignored by the checkpoint


@pytest.fixture(scope="module")
def float32_reference(smollm2_dir):
    """Float32's greedy answers to three prompts, teacher-forced back through float32."""
    tokenizer = Tokenizer(smollm2_dir)
    questions = ["Explain photosynthesis briefly.", "What is a hash table?", "Write a haiku about rain."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    engine = make_engine(smollm2_dir)
    answers = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    texts = [prompt + answer.outputs[0].token_ids for prompt, answer in zip(prompts, answers)]
    return texts, [len(prompt) for prompt in prompts], _score(engine, texts)


def _score(engine, texts):
    return engine.generate(texts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))


def test_an_fp8_checkpoint_loads_as_stored_and_agrees_with_float32(fp8_checkpoint, float32_reference):
    """Loaded bit for bit: per-tensor scales of fused q/k/v and gate/up become per-channel ones, each
    projection keeping its own. Teacher-forced over float32's greedy answers (3 x 48 tokens), the FP8
    checkpoint's top choice is float32's at >= 85% of positions and the answer's logprobs move by
    < 0.15 on average. Measured over these 144 positions: ModelOpt per-tensor 0.896 and 0.099,
    compressed-tensors per-channel 0.924 and 0.099. The per-channel checkpoint holds the weights
    `quantization: fp8` computes, and over 3 x 64 tokens both gave 0.938 and 0.092."""
    method, path, tensors = fp8_checkpoint
    engine = make_engine(path)  # no quantization setting: the checkpoint implies it
    _check_weights(engine.runner.shard.model, tensors)
    texts, prompt_lens, reference = float32_reference
    scored = _score(engine, texts)
    positions = [(i, p) for i, (text, start) in enumerate(zip(texts, prompt_lens)) for p in range(start, len(text))]
    agree = sum(scored[i].prompt_top_logprobs[p][0][0] == texts[i][p] for i, p in positions) / len(positions)
    drift = sum(abs(scored[i].prompt_logprobs[p] - reference[i].prompt_logprobs[p]) for i, p in positions)
    assert agree >= 0.85 and drift / len(positions) < 0.15, (method, agree, drift / len(positions))


def test_each_tensor_parallel_rank_loads_its_slice_of_weights_and_scales(fp8_checkpoint, caplog):
    """Rank 1 of 3 (SmolLM2's 9 heads and 3 KV heads split three ways): column linears slice weights
    and scales by output, row linears slice weights by input and keep every output's scale."""
    _, path, tensors = fp8_checkpoint
    with caplog.at_level(logging.WARNING):
        model = load_model(path, torch.float32, torch.device("cpu"), 64, layout=ParallelLayout(tp_size=3, rank=1),
                           tp=TensorParallel(3, 1))
    _check_weights(model, tensors, tp=3, rank=1)
    assert "KV-cache quantization (kv_cache_quant_algo, kv_cache_scheme) is not applied" in caplog.text


@pytest.mark.parametrize("scale_shape", [(), (8, 1)])
def test_a_fused_checkpoint_tensor_splits_its_scales_between_projections(scale_shape):
    """Phi-3's qkv_proj arrives fused: one scale for all of it, or one per channel, on rank 1 of 2."""
    linear = MergedLinear(8, [4, 2, 2], bias=False, dtype=torch.float32, tp=TensorParallel(2, 1), parallel="column")
    linear.hold_fp8()
    weight, scale = torch.randn(8, 8).to(FP8), torch.rand(scale_shape) + 0.5
    linear.load_fused("weight", weight)
    linear.load_fused("weight_scale", scale)
    rows = [2, 3, 5, 7]  # rank 1's half of q (rows 0-3), of k (4-5) and of v (6-7)
    assert torch.equal(linear.weight.view(torch.uint8), weight[rows].view(torch.uint8))
    assert torch.equal(linear.weight_scale, scale.reshape(-1).expand(8)[rows][None])


COMPRESSED_FP8_GROUP = QUANTIZATION_CONFIGS["compressed-tensors"]["config_groups"]["group_0"]


@pytest.mark.parametrize("quantization_config, modelopt_file, refused", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, None, "a gptq checkpoint"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, None, "a fp8 checkpoint"),
    (None, {"quantization": {"quant_algo": "NVFP4", "group_size": 16}}, "ModelOpt quant_algo NVFP4"),
    ({**QUANTIZATION_CONFIGS["modelopt"], "quant_algo": "FP8_PB_WO"}, None, "ModelOpt quant_algo FP8_PB_WO"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
     None, "compressed-tensors checkpoint with format pack-quantized"),
    ({**QUANTIZATION_CONFIGS["compressed-tensors"], "config_groups": {"group_0": {
        **COMPRESSED_FP8_GROUP, "weights": {**COMPRESSED_FP8_GROUP["weights"], "strategy": "block",
                                            "block_structure": [128, 128]}}}},
     None, r"config_groups.group_0.weights \(num_bits 8, type float, strategy block"),
    ({**QUANTIZATION_CONFIGS["compressed-tensors"], "sparsity_config": {"format": "sparse-24-bitmask"}},
     None, "sparsity_config format sparse-24-bitmask"),
])
def test_a_quantization_this_engine_does_not_load_is_refused_by_name(tiny_llama_dir, tmp_path, quantization_config,
                                                                     modelopt_file, refused):
    shutil.copytree(tiny_llama_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    if modelopt_file:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(modelopt_file))
    with pytest.raises(ValueError, match=refused):
        make_engine(tmp_path)


@pytest.mark.parametrize("fp8_projections, q_scale_shape, refused", [
    (("q_proj",), (), r"'model.layers.0.self_attn.k_proj.weight' .* a torch.float32 weight for a linear held in "
                      "torch.float8_e4m3fn"),
    (("q_proj", "k_proj", "v_proj"), (4, 4), r"a weight_scale of shape \[4, 4\] for 64 output channels"),
])
def test_an_fp8_checkpoint_that_breaks_its_format_is_refused(tiny_llama_dir, tmp_path, fp8_projections,
                                                             q_scale_shape, refused):
    """An FP8 q_proj beside a 16-bit k_proj (one fused linear holds both), or block-wise scales."""
    shutil.copytree(tiny_llama_dir, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    for projection in fp8_projections:
        name = f"model.layers.0.self_attn.{projection}.weight"
        tensors[name] = tensors[name].to(FP8)
        tensors[name + "_scale"] = torch.ones(q_scale_shape if projection == "q_proj" else ())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIGS["modelopt"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=refused):
        make_engine(tmp_path)
