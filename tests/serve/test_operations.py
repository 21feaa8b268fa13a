"""Operations on a live server: the request guard, preemption under a tight KV cache, replicas
killed mid-stream, redeploy with requests in flight. One app ("/ops") of its own, so its faults
touch no other test; its tests run in file order, the destructive ones last."""
import json
import threading
import time

import httpx
import pytest
import ray
import yaml

from tests.serve.conftest import _write_config

KEY = "ops-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"text_input": "Tell me a very long story about the sea.", "max_tokens": 300, "ignore_eos": True}


def _ops_config(tmp_path_factory, lora_root, **changes):
    stages = yaml.safe_load(open("configs/smollm2-135m.yaml"))["serve"]
    for stage in stages.values():
        stage["graceful_shutdown_timeout_s"] = 300  # a loaded CI machine streams slowly
    return _write_config(tmp_path_factory, lora_root, served_model_name="smollm2-ops", api_key=KEY,
                         max_request_bytes=8192, max_input_len=256, max_output_len=400,
                         scheduler_policy="MAX_UTILIZATION", max_seq_len=1024,
                         kv_cache_config={"max_tokens": 1024, "tokens_per_block": 32}, serve=stages, **changes)


@pytest.fixture(scope="module")
def ops(server, tmp_path_factory, lora_root):
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app({"config": str(_ops_config(tmp_path_factory, lora_root))}), name="ops", route_prefix="/ops")
    with httpx.Client(base_url=f"{server}/ops", timeout=120, headers=AUTH) as client:
        yield client
    serve.delete("ops")


def _events(lines) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_api_key_on_every_route_but_health(ops):
    bare = httpx.Client(base_url=str(ops.base_url), timeout=60)
    assert bare.get("/v2/health/ready").status_code == 200 and bare.get("/v2/health/live").status_code == 200
    r = bare.post("/v2/models/ensemble/generate", json={"text_input": "hi", "max_tokens": 2})
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer" and "authorization" in r.json()["error"]
    r = bare.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["param"] == "authorization"
    assert bare.get("/stats").status_code == 401
    assert ops.post("/v2/models/ensemble/generate", json={"text_input": "hi", "max_tokens": 2}).status_code == 200


def test_body_size_and_length_limits(ops):
    big = {"text_input": "x" * 9000, "max_tokens": 2}
    r = ops.post("/v2/models/ensemble/generate", json=big)
    assert r.status_code == 413 and "8192" in r.json()["error"]

    def chunked():  # no Content-Length: the limit holds while reading
        yield json.dumps(big).encode()

    r = ops.post("/v2/models/ensemble/generate", content=chunked())
    assert r.status_code == 413 and "8192" in r.json()["error"]
    r = ops.post("/v2/models/ensemble/generate", json={"text_input": "word " * 300, "max_tokens": 2})
    assert r.status_code == 400 and "max_input_len of 256" in r.json()["error"]
    r = ops.post("/v1/completions", json={"model": "smollm2-ops", "prompt": "hi", "max_tokens": 401})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "max_output_len of 400" in r.json()["error"]["message"]


def test_kv_exhaustion_preempts_and_every_request_completes(ops):
    """6 x 220 generated tokens need more than the 1024-token cache: MAX_UTILIZATION preempts
    and recomputes; every request still gets all of its tokens."""
    import concurrent.futures

    before = ops.get("/stats").json()["num_preempted_total"]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: ops.post("/v2/models/ensemble/generate", timeout=600, json={
            **LONG, "max_tokens": 220, "text_input": f"Story number {i}:", "return_log_probs": True}), range(6)))
    assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200]
    assert all(len(r.json()["output_log_probs"]) == 220 for r in results)
    stats = ops.get("/stats").json()
    assert stats["num_preempted_total"] > before and stats["used_blocks"] == 0


def _replica(deployment: str):
    """A live replica's actor handle, found by Serve's actor naming (SERVE_REPLICA::app#deployment#id)."""
    prefix = f"SERVE_REPLICA::ops#{deployment}#"
    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))
    return ray.get_actor(name, namespace="serve")


def _recover(ops, started: float, limit_s: float = 90) -> float:
    while time.monotonic() - started < limit_s:
        try:
            if ops.post("/v2/models/ensemble/generate", json={"text_input": "Hi", "max_tokens": 3},
                        timeout=20).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"no answer {limit_s} s after the kill")


@pytest.mark.parametrize("deployment", ["Engine", "Detokenizer", "Tokenizer"])
def test_replica_killed_mid_stream_ends_the_stream_and_is_replaced(ops, deployment):
    """Kill a replica (by its actor handle) while a stream runs: a stream through it ends with an
    error event at once, never a hang; the tokenizer is done with a running stream, which must
    finish untouched, and token ids go on without it. Either way a replacement replica serves new
    requests."""
    body = {**LONG, "max_tokens": 40} if deployment == "Tokenizer" else LONG
    ids = {"input_ids": [[1, 504, 3458, 282, 4649, 314]], "request_output_len": 6}
    before = ops.post("/v2/models/tensorrt_llm/generate", json=ids) if deployment == "Tokenizer" else None
    assert before is None or before.status_code == 200, before.text
    with ops.stream("POST", "/v2/models/ensemble/generate_stream", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "text_output" in first
        killed = time.monotonic()
        replica = _replica(deployment)
        ray.kill(replica, no_restart=True)
        if deployment == "Tokenizer":
            _served_without_a_tokenizer(ops, replica, ids, before)
        rest = _events(lines)
        ended_after = time.monotonic() - killed
    if deployment == "Tokenizer":
        assert rest and "error" not in rest[-1] and rest[-1]["finish_reason"] == "length"
    else:
        assert rest and "error" in rest[-1] and "replica" in rest[-1]["error"], rest[-1:]
        assert ended_after < 10
        # Readiness asks every stage: not ready until the replacement serves.
        assert ops.get("/v2/health/ready").status_code == 503
    if deployment == "Detokenizer":  # the engine stops generating for the dead consumer
        print(f"engine KV freed {_kv_freed_after(killed):.1f} s after the kill")
    recovered = _recover(ops, killed)
    print(f"{deployment}: stream ended {ended_after:.1f} s after the kill; new requests served after {recovered:.1f} s")


def _served_without_a_tokenizer(ops, killed, ids: dict, before: httpx.Response) -> None:
    """Token ids with nothing to tokenize never go to the Tokenizer: such a request is answered while
    the killed Tokenizer replica is dead, sooner than Serve notices and replaces it (its health
    checks run every 10 s by default; docs/PERFORMANCE.md has replacements serving after 10-14 s).
    A request that needed the Tokenizer would fail or wait for the replacement."""
    deadline = time.monotonic() + 30
    while True:  # ray.kill returns before the actor is gone
        try:
            ray.get(killed.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            break
        except ray.exceptions.GetTimeoutError:
            pass  # dying, not yet dead
        assert time.monotonic() < deadline, "the killed Tokenizer replica is not gone after 30 s"
        time.sleep(0.1)
    during = ops.post("/v2/models/tensorrt_llm/generate", json=ids, timeout=8)
    assert during.status_code == 200, during.text
    assert len(during.json()["output_ids"]) == len(before.json()["output_ids"])


def test_an_adapter_brought_by_path_survives_its_engine_replica(ops, lora_root):
    """A request brings an adapter by path, later ones name it alone. The engine replica that loaded
    it dies and Serve starts another, which never saw the path: the name alone still serves the
    adapter, loaded from the path the first replica recorded (not "not loaded")."""
    body = {"text_input": "Write a short greeting:", "max_tokens": 12, "lora_task_id": 4242}
    first = ops.post("/v2/models/ensemble/generate", json={**body, "lora_path": str(lora_root / "poet")})
    assert first.status_code == 200, first.text
    killed = time.monotonic()
    ray.kill(_replica("Engine"), no_restart=True)
    _recover(ops, killed)
    again = ops.post("/v2/models/ensemble/generate", json=body)
    assert again.status_code == 200, again.text
    assert again.json()["text_output"] == first.json()["text_output"]
    assert ops.post("/v2/models/ensemble/generate", json={**body, "lora_task_id": 4243}).status_code == 400
    rebound = ops.post("/v2/models/ensemble/generate", json={**body, "lora_path": str(lora_root / "pirate")})
    assert rebound.status_code == 409, rebound.text


def _engine_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("Engine", app_name="ops").stats.remote().result(timeout_s=30)


def _kv_freed_after(since: float, limit_s: float = 10.0) -> float:
    """Seconds from `since` until the engine holds no request and no KV block (fails past limit_s)."""
    while time.monotonic() - since < limit_s:
        stats = _engine_stats()
        if stats["used_blocks"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return time.monotonic() - since
        time.sleep(0.1)
    raise AssertionError(f"the engine still holds work {limit_s} s after its consumer died: {_engine_stats()}")


def test_ingress_killed_mid_stream_frees_the_engine(ops):
    """Ray does not cancel a stream whose caller died: without the consumer watch the engine ran
    all 16 generations on to max_tokens for nobody. Now the stages below abort them in seconds."""
    def stream(i):
        try:
            with ops.stream("POST", "/v2/models/ensemble/generate_stream",
                            json={**LONG, "text_input": f"Story {i}:", "max_tokens": 200}) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass  # the connection dies with the Ingress

    readers = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(16)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 60
    while _engine_stats()["num_running"] < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _engine_stats()["used_blocks"] > 0
    killed = time.monotonic()
    ray.kill(_replica("Ingress"), no_restart=True)
    freed = _kv_freed_after(killed)
    print(f"Ingress killed with 16 streams: engine KV back to 0 after {freed:.1f} s")
    assert freed < 5.0
    _recover(ops, killed)


def test_a_restarted_id_registry_keeps_ids_unique_on_its_ingress(ops):
    """The request id registry restarts empty. A second request under an id still streaming on the
    same Ingress replica is refused there (409), and the first ends as it would have. The new
    registry took the second: the two then shared the replica's stop event, and the first to end
    removed the other's (KeyError: a finished generation turned into an error)."""
    request_id = f"registry-restart-{time.monotonic_ns()}"
    with ops.stream("POST", "/v2/models/ensemble/generate_stream",
                    json={**LONG, "max_tokens": 120, "request_id": request_id}, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        ray.kill(_replica("RequestIds"), no_restart=True)
        # Its claim would wait for the new, empty registry, which would take it.
        twin = ops.post("/v2/models/ensemble/generate", json={"text_input": "Hi", "max_tokens": 2,
                                                              "request_id": request_id})
        assert twin.status_code == 409 and twin.json()["error"].startswith("request_id"), twin.text
        rest = _events(lines)
    assert rest and "error" not in rest[-1] and rest[-1]["finish_reason"] == "length", rest[-1:]


def test_redeploy_finishes_requests_in_flight(ops, tmp_path_factory, lora_root):
    """A new config rolls every replica; a stream running through the old ones completes in full,
    and new requests go to the new replicas."""
    from ray import serve

    from deployments.app import build_app

    new = build_app({"config": str(_ops_config(tmp_path_factory, lora_root, max_tokens_default=32))})
    events: list[dict] = []

    def stream():
        with ops.stream("POST", "/v2/models/ensemble/generate_stream", json={**LONG, "max_tokens": 80}) as r:
            events.extend(_events(r.iter_lines()))

    reader = threading.Thread(target=stream)
    reader.start()
    time.sleep(2.0)
    serve.run(new, name="ops", route_prefix="/ops")  # returns when the new replicas are up
    reader.join(timeout=300)
    assert not reader.is_alive() and events and "error" not in events[-1], events[-1:]
    assert sum(len(e["text_output"]) > 0 for e in events) > 1 and events[-1]["finish_reason"] == "length"
    r = ops.post("/v2/models/ensemble/generate", json={"text_input": "Hi"})  # the new default: 32 tokens
    assert r.status_code == 200
