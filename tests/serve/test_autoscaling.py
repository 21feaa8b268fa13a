"""Autoscaling that drains, through real Serve on loopback. A module of its own, so it runs while
few other apps are alive: it scales to a second engine replica, the largest memory step of the
serve tests on the 24 GiB CI machine."""
import json
import threading
import time

import httpx
import pytest
import yaml
from ray import serve

from deployments.app import build_app
from tests.serve.conftest import _write_config


@pytest.fixture(scope="module")
def autoscaling_server(server, tmp_path_factory, lora_root):
    stages = yaml.safe_load(open("configs/smollm2-135m.yaml"))["serve"]
    stages["engine"]["autoscaling"] = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                                       "upscale_delay_s": 0.5, "downscale_delay_s": 4, "look_back_period_s": 2,
                                       "metrics_interval_s": 0.5}
    # The drain waits for the stream below however slow the shared CI box runs it (a stream still
    # going when the grace period ends is cut; 60 s by default, and CI once took longer).
    stages["engine"]["graceful_shutdown_timeout_s"] = 600
    path = _write_config(tmp_path_factory, lora_root, served_model_name="smollm2-auto", serve=stages,
                         kv_cache_config={"max_tokens": 8192})
    serve.run(build_app({"config": str(path)}), name="auto", route_prefix="/auto")
    yield f"{server}/auto"
    serve.delete("auto")


def _engine_replicas(app: str) -> int:
    status = serve.status().applications[app].deployments["Engine"]
    return status.replica_states.get("RUNNING", 0)


def _stream(url: str, max_tokens: int, results: list) -> None:
    body = {"text_input": "Write a long story about a lighthouse keeper.", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    text, error = "", None
    with httpx.stream("POST", f"{url}/v2/models/ensemble/generate_stream", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                error = event.get("error", error)
                text += event.get("text_output", "")
    results.append((r.status_code, error, text))


def test_load_scales_the_engine_up_and_back_down_without_cutting_a_stream(autoscaling_server):
    assert _engine_replicas("auto") == 1
    results: list = []
    load = [threading.Thread(target=_stream, args=(autoscaling_server, 128, results)) for _ in range(4)]
    for t in load:
        t.start()
    deadline = time.monotonic() + 120
    while _engine_replicas("auto") < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _engine_replicas("auto") == 2
    for t in load:
        t.join()
    # One long stream keeps going while the load falls: scale-down must let it finish.
    tail: list = []
    last = threading.Thread(target=_stream, args=(autoscaling_server, 300, tail))
    last.start()
    deadline = time.monotonic() + 120
    while _engine_replicas("auto") > 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _engine_replicas("auto") == 1
    last.join()
    for status, error, text in results + tail:
        assert status == 200 and error is None and text
    assert len(tail) == 1 and len(tail[0][2]) > len(results[0][2])  # 300 tokens, uncut
