"""Real checkpoints load safely: sharded with an index (and nothing the index does not name), a
Hugging Face cache entry; a missing shard, a missing tensor or a quantized checkpoint stops
start-up with one sentence instead of serving uninitialised memory."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.engine import SamplingParams
from app.engine.model_dir import resolve_model_dir
from tests.conftest import make_engine, random_prompts

PROMPTS = random_prompts(2, 5, 20, vocab=256, seed=4)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    return [o.outputs[0].token_ids for o in make_engine(tiny_llama_dir).generate(PROMPTS, GREEDY)]


@pytest.fixture
def sharded(tiny_llama_dir, tmp_path):
    """The tiny Llama re-saved in shards of ~40 kB, with model.safetensors.index.json."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    return tmp_path


def _outputs(path):
    return [o.outputs[0].token_ids for o in make_engine(path).generate(PROMPTS, GREEDY)]


def test_sharded_checkpoint_reads_what_its_index_names(sharded, expected):
    # A stray file the index does not name (Mistral's consolidated.safetensors) is never read.
    save_file({"tok_embeddings.weight": torch.zeros(3, 3)}, sharded / "consolidated.safetensors")
    assert _outputs(sharded) == expected


def test_a_single_file_checkpoint_beside_a_consolidated_one_reads_its_own(tiny_llama_dir, tmp_path, expected):
    shutil.copytree(tiny_llama_dir, tmp_path, dirs_exist_ok=True)  # no index: model.safetensors alone
    save_file({"tok_embeddings.weight": torch.zeros(3, 3)}, tmp_path / "consolidated.safetensors")
    assert _outputs(tmp_path) == expected


def test_missing_shard_is_named(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (sharded / gone).unlink()
    with pytest.raises(FileNotFoundError, match=gone):
        make_engine(sharded)


def test_a_tensor_left_out_is_named(tiny_llama_dir, tmp_path):
    shutil.copytree(tiny_llama_dir, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"without weights: layers\.1\.self_attn\.qkv_proj\.weight"):
        make_engine(tmp_path)


def test_quantized_checkpoint_is_refused_by_format(tiny_llama_dir, tmp_path):
    shutil.copytree(tiny_llama_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="a awq checkpoint"):
        make_engine(tmp_path)


def test_a_tensor_with_no_place_is_refused(tiny_llama_dir, tmp_path):
    shutil.copytree(tiny_llama_dir, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.qweight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="qweight"):
        make_engine(tmp_path)


def test_a_hugging_face_cache_entry_is_a_model(tiny_llama_dir, tmp_path, expected):
    entry = tmp_path / "models--org--tiny"
    shutil.copytree(tiny_llama_dir, entry / "snapshots" / "abc123")
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("abc123")
    assert resolve_model_dir(str(entry)) == entry / "snapshots" / "abc123"
    assert _outputs(entry) == expected
