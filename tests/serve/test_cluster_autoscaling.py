"""Ray cluster autoscaling (issue 20): load makes Serve add an engine replica, Ray's autoscaler adds a
worker node for it, the replica serves there, and once the load is gone the replica drains and the
idle node is removed, with no stream cut on the way.

The cluster is Ray's own autoscaler (the monitor process of a head started with an autoscaling
config) driving its fake multi-node provider, which starts and stops worker nodes as raylet
processes on this machine. `ray.cluster_utils.AutoscalingCluster` would do the same but cannot be
used: its config template (fake_multi_node/example.yaml) is not in Ray's wheel, and its start and
shutdown run `ray stop --force`, which kills every Ray process on the machine, other tests' included.
So the head is a `Cluster` head given the autoscaling config. It has one CPU, of which the three
light stages take 0.75 (0.25 each, as shipped): an engine replica (1 CPU) never fits there, only on a
worker node of 1 CPU, where nothing fits beside it.

Like test_multinode.py, the cluster runs in a subprocess (`python -m tests.serve.test_cluster_autoscaling
CONFIG OUT`) that writes what it saw to OUT as JSON: a timeline sampled every half second and
the times of each step. tools/cluster_timeline.py prints and plots it."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from tests.conftest import hf_greedy
from app.engine.executor import free_port
from tools.cluster_timeline import report

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "What is machine learning?"  # greedy SmolLM2 writes 64 tokens before an end-of-sequence token
LOAD_TOKENS = 48
CLIENTS = 3  # streams kept in flight, each sent again as soon as it ends: 3 wanted replicas, capped at 2
HOLD_S = 5  # load kept on once the new node's replica serves, so it finishes streams of its own
OBJECT_STORE = 80 << 20  # each node's plasma store would otherwise take 30% of RAM
SCENARIO_TIMEOUT_S = 300


def test_load_adds_a_worker_node_that_serves_and_idleness_removes_it(tmp_path, smollm2_hf, smollm2_tokenizer):
    seen = run_scenario(tmp_path / "seen.json")
    print(report(seen))
    samples = seen["samples"]
    assert seen["workers_at_load"] == 1 and max(s["workers"] for s in samples) == 2 and samples[-1]["workers"] == 1
    assert seen["scale_up"]["serving_s"] < 60
    assert seen["new_node"] not in (seen["first_node"], seen["head"])  # the replica served on the added node

    ids = smollm2_tokenizer.encode(PROMPT)
    expected = smollm2_tokenizer.decode(hf_greedy(smollm2_hf, ids, LOAD_TOKENS), skip_special_tokens=True)
    streams = seen["streams"]
    assert len(streams) > CLIENTS  # streams were sent again while the cluster grew
    for stream in streams:  # none failed or cut: each ended with its finish, its usage and [DONE], whole
        assert stream["status"] == 200 and stream["error"] is None and stream["done"], stream
        assert stream["finish_reason"] == "length" and stream["completion_tokens"] == LOAD_TOKENS, stream
        assert stream["text"] == expected


def run_scenario(out: Path) -> dict:
    """Adapt configs/smollm2-135m.yaml, run the cluster in a subprocess, return what it wrote to `out`."""
    config = yaml.safe_load((ROOT / "configs/smollm2-135m.yaml").read_text())
    config.update(max_batch_size=8, max_seq_len=2048, kv_cache_config={"max_tokens": 2048, "tokens_per_block": 32})
    config["serve"]["engine"]["autoscaling"] = {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0.5,
        "downscale_delay_s": 4, "look_back_period_s": 2, "metrics_interval_s": 0.5}
    path = out.with_name("config.yaml")
    path.write_text(yaml.safe_dump(config))
    log = out.with_name("scenario.log")
    # A process group of its own, killed whole at the end: worker nodes are raylets that Ray's
    # monitor started, which the head's shutdown does not stop.
    with open(log, "w") as sink:
        run = subprocess.Popen([sys.executable, "-m", "tests.serve.test_cluster_autoscaling", str(path), str(out)],
                               cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = run.wait(timeout=SCENARIO_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # the last worker node outlives the head it belonged to: Ray's monitor started it
            try:
                os.killpg(run.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            run.wait()
    assert code == 0, f"the scenario {'timed out' if code is None else f'exited {code}'}: {log.read_text()[-8000:]}"
    return json.loads(out.read_text())


def main(config_path: str, out: str) -> None:
    import ray
    from ray import serve

    from deployments.app import build_app

    cluster = _start_cluster(Path(out).with_name("autoscaling.json"))
    ray.init(address=cluster.address, log_to_driver=False)
    head = cluster.head_node.node_id
    port = free_port("127.0.0.1")  # chosen once the head's processes hold their ports
    load = Load(f"http://127.0.0.1:{port}")
    recorder = Recorder(head, load)
    recorder.start()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"config": config_path}), name="llm", route_prefix="/")  # waits for the first worker node
    at_load = recorder.sample()
    (first,) = at_load["engines"]
    recorder.first_node = first
    workers_at_load = at_load["workers"]

    loaded = time.monotonic()
    load.start()
    if not recorder.serving_elsewhere.wait(120):
        raise TimeoutError("no engine replica served on a second worker node 120 s after the load started")
    time.sleep(HOLD_S)
    load.stop()
    unloaded = time.monotonic()
    while recorder.sample()["workers"] > workers_at_load:
        if time.monotonic() - unloaded > 120:
            raise TimeoutError("the added worker node was still there 120 s after the load ended")
        time.sleep(0.5)
    recorder.stop()

    seen = {"head": head, "first_node": first, "new_node": recorder.new_node, "workers_at_load": workers_at_load,
            "load_start_s": loaded - recorder.t0, "load_end_s": unloaded - recorder.t0,
            "scale_up": recorder.scale_up(loaded), "scale_down": recorder.scale_down(unloaded),
            "samples": recorder.samples, "streams": load.results}
    Path(out).write_text(json.dumps(seen))
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def _start_cluster(autoscaling: Path):
    """A head whose monitor runs Ray's autoscaler over the fake multi-node provider; no worker node yet."""
    import ray
    from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID
    from ray.cluster_utils import Cluster

    # Read by the monitor, which inherits them: an autoscaler update a second, and the fake provider
    # refuses to start without RAY_FAKE_CLUSTER.
    os.environ.update(AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_FAKE_CLUSTER="1")
    gcs_port = free_port("127.0.0.1")
    autoscaling.write_text(json.dumps(_autoscaling_config(f"{ray._private.services.get_node_ip_address()}:{gcs_port}")))
    # The head takes the node id the provider knows it by (as `ray start --head` does for a fake
    # cluster): the autoscaler then sees the CPU its stages use, not the config's idle head.
    return Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "gcs_server_port": gcs_port, "autoscaling_config": str(autoscaling),
        "env_vars": {"RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID},
        "include_dashboard": False, "object_store_memory": OBJECT_STORE})


def _autoscaling_config(gcs: str) -> dict:
    """The fake multi-node provider's cluster config (fake_multi_node/example.yaml upstream): a head
    of 1 CPU, worker nodes of 1 CPU, 0 to 2 of them, idle ones removed after 6 s."""
    return {
        "cluster_name": "llm-serve-autoscaling-test", "max_workers": 2, "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1, "head_node_type": "ray.head.default",
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": gcs},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            "engine.worker": {"resources": {"CPU": 1, "object_store_memory": OBJECT_STORE}, "node_config": {},
                              "min_workers": 0, "max_workers": 2}},
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": []}


class Recorder:
    """Samples the cluster every half second in a thread of its own: streams in flight, running
    engine replicas, alive worker nodes, and the node of each engine replica with the requests it
    is working on, which tells when a replica on a node other than the first serves."""

    def __init__(self, head: str, load: "Load"):
        self.head, self.load, self.t0 = head, load, time.monotonic()
        self.samples: list[dict] = []
        self.first_node: str | None = None
        self.new_node: str | None = None
        self.serving_elsewhere = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.sample())  # the state main saw last

    def sample(self) -> dict:
        import ray
        from ray import serve

        workers = sum(1 for node in ray.nodes() if node["Alive"] and node["NodeID"] != self.head)
        app = serve.status().applications.get("llm")
        engine = app.deployments.get("Engine") if app else None  # listed only once Serve has created it
        replicas = engine.replica_states.get("RUNNING", 0) if engine else 0
        engines = {}
        for actor in ray._private.state.actors().values():  # the GCS's table: the dashboard is off
            if actor["State"] == "ALIVE" and actor["Name"].startswith("SERVE_REPLICA::llm#Engine#"):
                try:
                    replica = ray.get_actor(actor["Name"], namespace="serve")
                    ongoing = ray.get(replica.get_num_ongoing_requests.remote(), timeout=10)
                except (ray.exceptions.RayError, ValueError):  # stopped since the table was read
                    continue
                engines[actor["Address"]["NodeID"]] = ongoing
        return {"t": time.monotonic() - self.t0, "in_flight": self.load.in_flight, "replicas": replicas,
                "workers": workers, "engines": engines}

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            sample = self.sample()
            self.samples.append(sample)
            if self.first_node is not None and self.new_node is None:
                self.new_node = next((node for node, ongoing in sample["engines"].items()
                                      if node != self.first_node and ongoing > 0), None)
                if self.new_node is not None:
                    self.serving_elsewhere.set()

    def _after(self, start: float, reached) -> float:
        """Seconds from `start` (time.monotonic()) to the first sample since then where `reached` holds."""
        since = start - self.t0
        return next(s["t"] for s in self.samples if s["t"] >= since and reached(s)) - since

    def scale_up(self, loaded: float) -> dict:
        return {"node_s": self._after(loaded, lambda s: s["workers"] == 2),
                "replica_s": self._after(loaded, lambda s: s["replicas"] == 2),
                "serving_s": self._after(loaded, lambda s: s["engines"].get(self.new_node, 0) > 0)}

    def scale_down(self, unloaded: float) -> dict:
        return {"replica_s": self._after(unloaded, lambda s: s["replicas"] == 1),
                "node_s": self._after(unloaded, lambda s: s["workers"] == 1)}


class Load:
    """CLIENTS threads, each sending the greedy stream again as soon as its last one ended, until stopped."""

    def __init__(self, url: str):
        self.url = url
        self.in_flight = 0
        self.results: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client) for _ in range(CLIENTS)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Returns when every stream has ended."""
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _client(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self.in_flight += 1
            result = _stream(self.url)
            with self._lock:
                self.in_flight -= 1
                self.results.append(result)


def _stream(url: str) -> dict:
    """One greedy /v1/completions stream: its status, text, finish, usage, [DONE] and any error event."""
    import httpx

    body = {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": LOAD_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    seen = {"status": None, "text": "", "finish_reason": None, "completion_tokens": None, "done": False, "error": None}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:  # a hang is a ReadTimeout
            seen["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    seen["done"] = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    seen["error"] = chunk.get("error", seen["error"])
                    for choice in chunk.get("choices", []):
                        seen["text"] += choice["text"]
                        seen["finish_reason"] = choice["finish_reason"] or seen["finish_reason"]
                    if chunk.get("usage"):
                        seen["completion_tokens"] = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        seen["error"] = repr(exc)
    return seen


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
