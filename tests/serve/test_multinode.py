"""The app on a Ray cluster of several nodes (issue 20): a head without CPUs and two worker nodes of
one CPU each (ray.cluster_utils, one machine), so a pipeline-parallel engine replica of SmolLM2 (one
CPU bundle per rank, PP 2) must put its stages on different nodes. TP x PP within a node is the
single-node tests' (test_scale_out.py); one rank per stage keeps this cluster within CI's memory. It serves over HTTP what transformers generates, and a rank on a node without
the model's path says so in one sentence. Then a spare worker node joins (as the autoscaler would add
one) and a stage's node is lost mid-stream: the stream ends with an error event, Serve places the
replica again on the surviving stage's node and the spare, and service resumes (timed).

The other tests of this package share one Ray instance in the pytest process; a cluster of its
own runs in a subprocess (`python -m tests.serve.test_multinode CONFIG PORT OUT`), which writes what
it saw to OUT as JSON."""
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.conftest import hf_greedy
from app.engine.executor import free_port

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "What is machine learning?"
MISSING_MODEL = "/nonexistent/llm-serve-model"
# What a stream cut by the loss of a stage's node ends with: the engine's failed step (rank 0 lost
# its other stage) or the dead replica (rank 0's own node, or the Detokenizer's). A sentence, never
# the remote traceback.
NODE_LOSS_ERRORS = ("the engine step computing this request failed", "a replica serving this request died")


def test_pipeline_stages_on_two_nodes_serve_what_transformers_generates(tmp_path, smollm2_hf, smollm2_tokenizer):
    config = yaml.safe_load((ROOT / "configs/smollm2-135m.yaml").read_text())
    config.update(tensor_parallel_size=1, pipeline_parallel_size=2, max_batch_size=8, max_seq_len=2048,
                  kv_cache_config={"max_tokens": 2048, "tokens_per_block": 32})
    for stage in ("ingress", "tokenizer", "detokenizer"):  # only the engine's bundles need the nodes' CPUs
        config["serve"][stage]["num_cpus"] = 0
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "seen.json"
    run = subprocess.run([sys.executable, "-m", "tests.serve.test_multinode", str(path), str(free_port("127.0.0.1")), str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    seen = json.loads(out.read_text())

    ranks = seen["ranks"]  # stage-major: [stage 0, stage 1]
    assert len(ranks) == 2 and ranks[0]["placement_group"] == ranks[1]["placement_group"]
    assert {ranks[0]["node"], ranks[1]["node"]} == set(seen["worker_nodes"])  # each stage on its own worker node

    ids = smollm2_tokenizer.encode(PROMPT)
    expected = smollm2_tokenizer.decode(hf_greedy(smollm2_hf, ids, 20), skip_special_tokens=True)
    assert seen["text_output"] == expected

    error = seen["missing_model_error"]  # what rank 0's launcher raised when rank 1's node lacked the model
    assert error is not None and error.startswith(
        f"an engine rank on node {seen['rank_one_ip']} (node id {seen['rank_one_node']}) cannot find model "
        f"'{MISSING_MODEL}': model paths must be on storage every node mounts"), error

    loss = seen["node_loss"]
    print(f"node of engine stage {loss['stage']} lost mid-stream: the stream ended after "
          f"{loss['stream_ended_s']:.1f} s, not ready after {loss['unready_s']:.1f} s, "
          f"service back after {loss['recovered_s']:.1f} s")
    last = loss["last_event"]
    assert last is not None and last.get("error", "").startswith(NODE_LOSS_ERRORS), last
    assert loss["stream_ended_s"] < 30 and loss["unready_s"] < 30 and loss["recovered_s"] < 120
    after, survivor = loss["ranks"], ranks[1 - loss["stage"]]["node"]
    assert len(after) == 2 and after[0]["placement_group"] == after[1]["placement_group"]
    assert {after[0]["node"], after[1]["node"]} == {survivor, seen["spare_node"]}  # not the lost node
    assert loss["text_output"] == expected


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
    nodes = [cluster.add_node(num_cpus=1, **small) for _ in range(2)]
    workers = [node.node_id for node in nodes]
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
    seen = {"ranks": ranks, "worker_nodes": workers, "text_output": r.json()["text_output"],
            "missing_model_error": missing_model_error, "rank_one_node": rank_one_node,
            "rank_one_ip": ips[rank_one_node]}

    spare = cluster.add_node(num_cpus=1, **small)
    cluster.wait_for_nodes()
    seen.update(spare_node=spare.node_id, node_loss=_lose_a_stage_node(cluster, nodes, ranks, port))
    Path(out).write_text(json.dumps(seen))
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def _lose_a_stage_node(cluster, nodes, ranks: list[dict], port: int) -> dict:
    """Remove the node of one engine stage (no graceful stop) once a long stream's first event has
    arrived; time the stream's end, readiness failing and the first answer after; where the
    replica's ranks are then."""
    import httpx
    import ray
    from ray import serve

    # The Ingress writes the stream's events, so it must outlive the node. Ray places it on any node
    # (it takes no CPU here): lose rank 1's node unless the Ingress is there (rank 0, the replica,
    # lives on and must notice that its other stage is gone), else rank 0's. The dashboard is off,
    # so the actor table comes from the GCS.
    ingress = next(a["Address"]["NodeID"] for a in ray._private.state.actors().values()
                   if a["State"] == "ALIVE" and a["Name"].startswith("SERVE_REPLICA::llm#Ingress#"))
    stage = 1 if ranks[1]["node"] != ingress else 0
    lost = next(node for node in nodes if node.node_id == ranks[stage]["node"])
    url = f"http://127.0.0.1:{port}/v2/models/ensemble"
    long = {"text_input": "Tell me a very long story about the sea.", "max_tokens": 1000, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/generate_stream", json=long, timeout=30) as r:  # a hang is a ReadTimeout
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        killed = time.monotonic()
        cluster.remove_node(lost, allow_graceful=False)
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    stream_ended = time.monotonic() - killed
    # No request before readiness fails: a replica whose rank was lost must find out by itself (a
    # failed step would tell it, but an idle replica takes none).
    while httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=30).status_code == 200:
        assert time.monotonic() - killed < 60, "still ready 60 s after the node was lost"
        time.sleep(0.5)
    unready = time.monotonic() - killed
    while True:  # 503s (or a timeout) while Ray notices the loss and Serve replaces what ran there
        try:
            answer = httpx.post(f"{url}/generate", json={"text_input": PROMPT, "max_tokens": 20}, timeout=30)
            if answer.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() - killed < 300, "no answer 300 s after the node was lost"
        time.sleep(0.5)
    recovered = time.monotonic() - killed
    after = serve.get_deployment_handle("Engine", app_name="llm").placement.remote().result(timeout_s=60)
    return {"stage": stage, "last_event": events[-1] if events else None, "stream_ended_s": stream_ended,
            "unready_s": unready, "recovered_s": recovered, "ranks": after, "text_output": answer.json()["text_output"]}


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
