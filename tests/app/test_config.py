"""The config schema: defaults from the engine, one-sentence errors naming the key."""
from pathlib import Path

import pytest

from app.config import ConfigError, load_config, parse_config
from app.engine import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_configs_load():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        config = load_config(path)
        assert config.engine_config().model == config.model


def test_defaults_come_from_the_engine():
    config = parse_config({})
    engine = config.engine_config()
    assert engine.max_batch_size == EngineConfig.max_batch_size
    assert engine.kv_cache_config.tokens_per_block == EngineConfig().kv_cache_config.tokens_per_block


@pytest.mark.parametrize("data, key", [
    ({"max_batch_sise": 8}, "max_batch_sise"),
    ({"kv_cache_config": {"tokens_per_blok": 16}}, "kv_cache_config.tokens_per_blok"),
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"scheduler_policy": "FASTEST"}, "scheduler_policy"),
    ({"serve": {"engine": {"num_replicas": "two"}}}, "serve.engine.num_replicas"),
    ({"kv_cache_config": {"tokens_per_block": 24}}, "tokens_per_block"),
])
def test_bad_keys_stop_start_up_with_one_sentence(data, key):
    with pytest.raises(ConfigError) as err:
        parse_config(data, "my.yaml")
    message = str(err.value)
    assert key in message and message.startswith("my.yaml") and "\n" not in message


def test_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
