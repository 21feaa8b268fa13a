"""Scale-out through real Serve on loopback: a TP x PP engine replica whose ranks sit in its
placement group, and prefix-affine routing over two replicas (autoscaling: test_autoscaling.py)."""

import httpx
import pytest
import ray
from ray import serve

from deployments.app import build_app
from tests.conftest import hf_greedy
from tests.serve.conftest import _write_config


@pytest.fixture(scope="module")
def parallel_server(server, tmp_path_factory, lora_root, tiny_chat_llama_dir):
    path = _write_config(tmp_path_factory, lora_root, model=str(tiny_chat_llama_dir), served_model_name="tiny-tp",
                         tensor_parallel_size=2, pipeline_parallel_size=2, lora_adapters={},
                         kv_cache_config={"max_tokens": 2048, "tokens_per_block": 16})
    serve.run(build_app({"config": str(path)}), name="parallel", route_prefix="/parallel")
    yield f"{server}/parallel"
    serve.delete("parallel")


def test_tp2_pp2_replica_serves_what_transformers_generates(parallel_server, tiny_chat_llama_dir):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_chat_llama_dir).eval()
    with httpx.Client(base_url=parallel_server, timeout=120) as http:
        for ids in ([1, 504, 3458, 314, 4649, 30], [1, 9 + 7, 250, 4000, 17, 33, 90, 121, 300, 700] * 5):
            r = http.post("/v2/models/tensorrt_llm/generate",
                          json={"input_ids": ids, "request_output_len": 12, "exclude_input_in_output": True})
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == hf_greedy(reference, ids, 12)


def test_ranks_run_in_the_replica_placement_group(parallel_server):
    engine = serve.get_deployment_handle("Engine", app_name="parallel")
    ranks = engine.placement.remote().result()
    assert len(ranks) == 4
    group = ranks[0]["placement_group"]
    assert group is not None and all(r["placement_group"] == group for r in ranks)
    table = ray.util.placement_group_table()[group]
    assert table["state"] == "CREATED" and table["strategy"] == "PACK"
    assert [b for b in table["bundles"].values()] == [{"CPU": 1.0}] * 4
    assert {r["node"] for r in ranks} <= set(table["bundles_to_node_id"].values())


def test_prefix_affinity_sends_a_shared_prefix_to_the_replica_that_holds_it(two_engine_server):
    """Two replicas; six requests that share a 6-block prefix, one at a time (even load): every
    request after the first finds the prefix's blocks cached, which a random pick would give each
    with probability 1/2."""
    prefix = "You are a careful assistant. Summarise the following notes in one line. " * 12
    with httpx.Client(base_url=two_engine_server, timeout=120) as http:
        reused = []
        for i in range(6):
            r = http.post("/v2/models/ensemble/generate", json={
                "text_input": f"{prefix} Note {i}: the meeting moved to {i + 2} pm.", "max_tokens": 2,
                "return_perf_metrics": True})
            assert r.status_code == 200, r.text
            reused.append(r.json()["kv_cache_reused_block"])
    assert all(n >= 5 for n in reused[1:]), reused
