"""How Engine replicas bind an adapter name to one path for the whole app (deployments/engine.py:
`_bound`), over a stand-in for Ray's key-value store that answers as the real one does: a put that
does not overwrite returns whether the key was there already."""
import asyncio
import json
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from app.adapters import AdapterPolicy
from app.engine.errors import InvalidRequestError
from app.protocol.messages import AdapterRef
from deployments import engine as engine_stage


class Store:
    """Ray's internal_kv, in memory: puts and gets from threads, each slow enough to interleave."""

    def __init__(self):
        self.values: dict[tuple[str, str], bytes] = {}
        self.lock = threading.Lock()
        self.down = False

    def _internal_kv_put(self, key, value, overwrite=True, namespace=None):
        time.sleep(0.01)
        if self.down:
            raise ConnectionError("GCS unavailable")
        with self.lock:
            existed = (namespace, key) in self.values
            if overwrite or not existed:
                self.values[(namespace, key)] = value.encode() if isinstance(value, str) else value
            return existed

    def _internal_kv_get(self, key, namespace=None):
        time.sleep(0.01)
        if self.down:
            raise ConnectionError("GCS unavailable")
        with self.lock:
            return self.values.get((namespace, key))


def _adapter(path, rank=2):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 4,
                                                          "target_modules": ["q_proj"]}))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": torch.ones(rank, 8), f"{prefix}.lora_B.weight": torch.ones(8, rank)},
              path / "adapter_model.safetensors")
    return str(path.resolve())


@pytest.fixture
def replicas(tmp_path, monkeypatch):
    """Two Engine replicas of one app (their binding state alone), sharing one store."""
    store = Store()
    monkeypatch.setattr(engine_stage, "internal_kv", store)
    made = []
    for _ in range(2):
        replica = object.__new__(engine_stage.EngineDeployment.func_or_class)
        replica.policy = AdapterPolicy([str(tmp_path)], {})
        replica.bound, replica.app_name, replica.max_lora_rank, replica.check_files = {}, "app", 64, True
        made.append(replica)
    return made, store, {name: _adapter(tmp_path / name) for name in ("poet", "chef")}


def test_two_first_uses_at_once_on_two_replicas_bind_one_path(replicas):
    (one, two), _, paths = replicas

    async def main():
        return await asyncio.gather(one._bound(AdapterRef("n", paths["poet"])),
                                    two._bound(AdapterRef("n", paths["chef"])), return_exceptions=True)

    for _ in range(3):
        results = asyncio.run(main())
        won = [r for r in results if isinstance(r, AdapterRef)]
        lost = [r for r in results if isinstance(r, InvalidRequestError)]
        assert len(won) == 1 and len(lost) == 1 and lost[0].status == 409
        loser = two if won[0].path == paths["poet"] else one
        assert asyncio.run(loser._bound(AdapterRef("n", None))).path == won[0].path  # by name: the winner's
        for replica in (one, two):
            replica.bound.clear()


def test_a_store_that_fails_refuses_with_503_and_binds_nothing(replicas):
    (one, two), store, paths = replicas
    asyncio.run(two._bound(AdapterRef("n", paths["chef"])))
    store.down = True
    with pytest.raises(InvalidRequestError) as refused:
        asyncio.run(one._bound(AdapterRef("n", paths["poet"])))
    assert refused.value.status == 503 and one.bound == {}
    store.down = False  # the store back: the name is the other replica's
    with pytest.raises(InvalidRequestError) as refused:
        asyncio.run(one._bound(AdapterRef("n", paths["poet"])))
    assert refused.value.status == 409


def test_files_that_are_no_adapter_are_refused_before_the_name_is_claimed(replicas, tmp_path):
    (one, _), store, paths = replicas
    (tmp_path / "empty").mkdir()
    spoiled = _adapter(tmp_path / "spoiled", rank=3)
    (tmp_path / "spoiled" / "adapter_config.json").write_text(json.dumps({"r": 2, "target_modules": ["q_proj"]}))
    for bad in (str((tmp_path / "empty").resolve()), spoiled):
        with pytest.raises(InvalidRequestError) as refused:
            asyncio.run(one._bound(AdapterRef("n", bad)))
        assert refused.value.status == 400
    assert store.values == {}
    assert asyncio.run(one._bound(AdapterRef("n", paths["poet"]))).path == paths["poet"]
