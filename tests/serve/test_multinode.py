"""The app on a Ray cluster of several nodes (issue 20): a head without CPUs and two worker nodes of
one CPU each (ray.cluster_utils, one machine), so a pipeline-parallel engine replica of SmolLM2 (one
CPU bundle per rank, PP 2) must put its stages on different nodes. TP x PP within a node is the
single-node tests' (test_scale_out.py); one rank per stage keeps this cluster within CI's memory. It serves over HTTP what transformers generates, and a rank on a node without
the model's path says so in one sentence.

The other tests of this package share one Ray instance in the pytest process; a cluster of its
own runs in a subprocess (`python -m tests.serve.test_multinode CONFIG PORT OUT`), which writes what
it saw to OUT as JSON."""
import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import hf_greedy
from tests.serve.conftest import _free_port

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "What is machine learning?"
MISSING_MODEL = "/nonexistent/llm-serve-model"


def test_pipeline_stages_on_two_nodes_serve_what_transformers_generates(tmp_path, smollm2_hf, smollm2_tokenizer):
    config = yaml.safe_load((ROOT / "configs/smollm2-135m.yaml").read_text())
    config.update(tensor_parallel_size=1, pipeline_parallel_size=2, max_batch_size=8, max_seq_len=2048,
                  kv_cache_config={"max_tokens": 2048, "tokens_per_block": 32})
    for stage in ("ingress", "tokenizer", "detokenizer"):  # only the engine's bundles need the nodes' CPUs
        config["serve"][stage]["num_cpus"] = 0
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "seen.json"
    run = subprocess.run([sys.executable, "-m", "tests.serve.test_multinode", str(path), str(_free_port()), str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    seen = json.loads(out.read_text())

    ranks = seen["ranks"]  # stage-major: [stage 0, stage 1]
    assert len(ranks) == 2 and ranks[0]["placement_group"] == ranks[1]["placement_group"]
    assert {ranks[0]["node"], ranks[1]["node"]} == set(seen["worker_nodes"])  # each stage on its own worker node

    ids = smollm2_tokenizer.encode(PROMPT)
    assert seen["text_output"] == smollm2_tokenizer.decode(hf_greedy(smollm2_hf, ids, 20), skip_special_tokens=True)

    error = seen["missing_model_error"]  # what rank 0's launcher raised when rank 1's node lacked the model
    assert error is not None and error.startswith(
        f"an engine rank on node {seen['rank_one_ip']} (node id {seen['rank_one_node']}) cannot find model "
        f"'{MISSING_MODEL}': model paths must be on storage every node mounts"), error


def main(config_path: str, port: int, out: str) -> None:
    import httpx
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from app.engine import EngineConfig
    from deployments.app import build_app
    from deployments.workers import PlacementGroupLauncher

    @ray.remote(num_cpus=1)
    def start_rank_one(model: str) -> str | None:
        try:
            PlacementGroupLauncher("cpu").start(1, {"config": EngineConfig(model=model)})
        except FileNotFoundError as exc:
            return str(exc)
        return None

    small = {"object_store_memory": 80 << 20}  # the plasma store of each node would take 30% of RAM
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False, **small})
    workers = [cluster.add_node(num_cpus=1, **small).node_id for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)

    # Rank 0 (a task in bundle 0) starts rank 1 on the other node, where the model's path is missing.
    group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
    ray.get(group.ready(), timeout=60)
    in_bundle_0 = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    missing_model_error = ray.get(start_rank_one.options(scheduling_strategy=in_bundle_0).remote(MISSING_MODEL))
    rank_one_node = placement_group_table(group)["bundles_to_node_id"][1]
    remove_placement_group(group)

    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"config": config_path}), name="llm", route_prefix="/")
    ranks = serve.get_deployment_handle("Engine", app_name="llm").placement.remote().result()
    r = httpx.post(f"http://127.0.0.1:{port}/v2/models/ensemble/generate",
                   json={"text_input": PROMPT, "max_tokens": 20}, timeout=120)
    r.raise_for_status()
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    Path(out).write_text(json.dumps({"ranks": ranks, "worker_nodes": workers, "text_output": r.json()["text_output"],
                                     "missing_model_error": missing_model_error, "rank_one_node": rank_one_node,
                                     "rank_one_ip": ips[rank_one_node]}))
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
