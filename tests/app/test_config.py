"""The config schema: defaults from the engine, one-sentence errors naming the key."""
from pathlib import Path

import pytest

from app.config import ConfigError, load_config, parse_config
from app.engine import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_configs_load():
    for path in sorted((ROOT / "configs").glob("*.yaml")) + [ROOT / "tools/gpu/llama-3.1-8b-dummy.yaml"]:
        config = load_config(path)
        assert config.engine_config().model == config.model


def test_defaults_come_from_the_engine():
    config = parse_config({})
    engine = config.engine_config()
    assert engine.max_batch_size == EngineConfig.max_batch_size
    assert engine.kv_cache_config.tokens_per_block == EngineConfig().kv_cache_config.tokens_per_block


def test_an_app_that_can_take_no_adapter_reserves_no_slots(tmp_path):
    """Adapters come only from lora_adapters or from paths under lora_roots: without either, the
    engine gets max_loras 0 (on a GPU, no device slots reserved for adapters), and an adapter
    registered on it anyway is refused by name."""
    from app.engine import InvalidRequestError
    from tests.conftest import make_engine

    assert parse_config({}).engine_config().max_loras == 0
    assert parse_config({"lora_roots": [str(tmp_path)]}).engine_config().max_loras == EngineConfig.max_loras
    with pytest.raises(InvalidRequestError, match="max_loras is 0"):
        make_engine(parse_config({}).engine_config().model, max_loras=0).add_lora("a", tmp_path)


@pytest.mark.parametrize("data, key", [
    ({"max_batch_sise": 8}, "max_batch_sise"),
    ({"kv_cache_config": {"tokens_per_blok": 16}}, "kv_cache_config.tokens_per_blok"),
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"scheduler_policy": "FASTEST"}, "scheduler_policy"),
    ({"serve": {"engine": {"num_replicas": "two"}}}, "serve.engine.num_replicas"),
    ({"kv_cache_config": {"tokens_per_block": 24}}, "tokens_per_block"),
    ({"speculative_config": {"decoding_type": "Lookahead"}}, "speculative_config.decoding_type 'Lookahead'"),
    ({"speculative_config": {"max_window_size": 4}}, "speculative_config.max_window_size"),
    ({"speculative_config": {"max_draft_len": 0}}, "speculative_config.max_draft_len"),
])
def test_bad_keys_stop_start_up_with_one_sentence(data, key):
    with pytest.raises(ConfigError) as err:
        parse_config(data, "my.yaml")
    message = str(err.value)
    assert key in message and message.startswith("my.yaml") and "\n" not in message


def test_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("data, says", [
    ({"cuda_graph_config": {"max_batch_size": 8}}, "cuda_graph_config is read by backend trtllm only"),
    ({"backend": "triton"}, "backend triton needs a 'triton' section with engine_dir"),
    ({"backend": "triton", "triton": {"engine_dir": "/e"}, "speculative_config": {"max_draft_len": 4}},
     "speculative_config is read by backends torch and trtllm"),
    ({"backend": "triton", "triton": {"engine_dir": "/e"}, "tensor_parallel_size": 2},
     "= 2 needs backend torch or trtllm"),
])
def test_backend_keys_are_checked_together(data, says):
    with pytest.raises(ConfigError, match=says):
        parse_config(data, "my.yaml")


def test_engine_replicas_own_their_gpus():
    assert "num_gpus" not in parse_config({}).engine_deployment_options()["ray_actor_options"]
    one = parse_config({"device": "cuda", "backend": "trtllm"}).engine_deployment_options()
    assert one["ray_actor_options"]["num_gpus"] == 1 and "placement_group_bundles" not in one
    tp = parse_config({"device": "cuda", "backend": "trtllm", "tensor_parallel_size": 2}).engine_deployment_options()
    assert tp["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1}, {"GPU": 1}]
    assert tp["placement_group_strategy"] == "STRICT_PACK" and "num_gpus" not in tp["ray_actor_options"]
    pp = parse_config({"device": "cuda", "backend": "trtllm", "tensor_parallel_size": 2,
                       "pipeline_parallel_size": 2}).engine_deployment_options()
    assert len(pp["placement_group_bundles"]) == 4 and pp["placement_group_strategy"] == "PACK"
    # The torch backend's replica is rank 0: it takes bundle 0's GPU and starts the other ranks.
    torch_tp = parse_config({"device": "cuda", "tensor_parallel_size": 2}).engine_deployment_options()
    assert torch_tp["ray_actor_options"]["num_gpus"] == 1
    assert torch_tp["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1}, {"GPU": 1}]
    # A CPU engine's ranks are CPU bundles, still one node for TP.
    cpu_tp = parse_config({"tensor_parallel_size": 2}).engine_deployment_options()
    assert cpu_tp["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1}]
    assert cpu_tp["placement_group_strategy"] == "STRICT_PACK"


def test_engine_routing_is_prefix_aware_by_default():
    router = parse_config({"kv_cache_config": {"tokens_per_block": 16}}).engine_deployment_options()
    assert router["request_router_config"]["request_router_class"] == "deployments.routing:PrefixAffinityRouter"
    assert router["request_router_config"]["request_router_kwargs"]["block_size"] == 16
    plain = parse_config({"routing": {"prefix_affinity": False}}).engine_deployment_options()
    assert "request_router_config" not in plain


def test_every_engine_field_has_a_config_key_with_its_default():
    """The service schema reaches every engine setting by name, and takes its default from the engine."""
    from dataclasses import MISSING, fields

    from app.config import ServiceConfig
    from app.engine.config import EngineConfig

    for field in fields(EngineConfig):
        assert field.name in ServiceConfig.model_fields, field.name
        if field.default is not MISSING:
            assert ServiceConfig.model_fields[field.name].default == field.default, field.name
    engine = parse_config({"cuda_graphs": False, "max_stop_words": 3}).engine_config()
    assert engine.cuda_graphs is False and engine.max_stop_words == 3
    speculative = parse_config({"speculative_config": {"max_draft_len": 3}}).engine_config().speculative_config
    assert (speculative.decoding_type, speculative.max_draft_len, speculative.max_matching_ngram_size) == ("NGram", 3, 3)
