"""Stop requests by id over real HTTP (Triton's `stop` input): the stream named ends at once with
its final event, its engine request is aborted and its KV freed, and ids stay unique in flight."""
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serve.conftest import run_with_replicas

LONG = {"text_input": "Tell me a very long story.", "max_tokens": 1500, "ignore_eos": True}
PROMPT_S = 5.0  # a stopped stream ends within this (it would run for tens of seconds)


def _id() -> str:
    return f"stop-test-{uuid.uuid4().hex}"


def _data(lines):
    for line in lines:
        if line.startswith("data: "):
            yield json.loads(line[len("data: "):])


def _kv_freed(http) -> bool:
    for _ in range(50):
        stats = http.get("/stats").json()
        if stats["num_running"] == 0 and stats["used_blocks"] == 0:
            return True
        time.sleep(0.1)
    return False


def _stop(base: str, model: str, request_id: str, route: str = "generate") -> httpx.Response:
    return httpx.post(f"{base}/v2/models/{model}/{route}", json={"request_id": request_id, "stop": True}, timeout=60)


def _stopped_stream(base: str, model: str, stop) -> tuple[list[dict], float]:
    """Stream a long generation, call `stop(request_id)` after its first event; the events and how
    long the stream took to end after the stop was answered."""
    request_id = _id()
    with httpx.stream("POST", f"{base}/v2/models/{model}/generate_stream", json={**LONG, "request_id": request_id},
                      timeout=60) as r:
        assert r.status_code == 200
        events = []
        for event in _data(r.iter_lines()):
            events.append(event)
            if len(events) == 1:
                stop(request_id)
                stopped_at = time.monotonic()
    return events, time.monotonic() - stopped_at


def _assert_ended_by_stop(events: list[dict], took_s: float) -> None:
    assert took_s < PROMPT_S, took_s
    assert events[-1]["sequence_end"] and events[-1]["finish_reason"] == "abort", events[-1]
    assert not any(e["sequence_end"] or "error" in e for e in events[:-1])
    assert len(events) < LONG["max_tokens"] // 2


@pytest.mark.parametrize("model, route", [("tensorrt_llm", "generate"), ("ensemble", "generate_stream")])
def test_a_stop_request_ends_the_stream_and_frees_its_kv(http, server, model, route):
    answers = []

    def stop(request_id):
        answers.append(_stop(server, model, request_id, route))

    events, took_s = _stopped_stream(server, model, stop)
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    # Triton's tensorrt_llm model answers a stop request with an empty response.
    empty = {"model_name": model, "model_version": "1"}
    if route == "generate":
        assert answer.json() == empty
    else:  # one such event
        assert list(_data(answer.text.splitlines())) == [empty]
    _assert_ended_by_stop(events, took_s)
    assert _kv_freed(http)


def test_a_unary_generate_and_kserve_stop(http, server):
    request_id = _id()
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(httpx.post, f"{server}/v2/models/ensemble/generate",
                            json={**LONG, "request_id": request_id}, timeout=60)
        deadline = time.monotonic() + 30
        stop = {"id": request_id, "inputs": [{"name": "stop", "datatype": "BOOL", "shape": [1, 1], "data": [True]}]}
        while (answer := http.post("/v2/models/tensorrt_llm/infer", json=stop)).status_code == 404:
            assert time.monotonic() < deadline, "the request never came in flight"
            time.sleep(0.05)
        assert answer.status_code == 200 and answer.json()["id"] == request_id and answer.json()["outputs"] == []
        r = whole.result(timeout=PROMPT_S)
    assert r.status_code == 200 and r.json()["finish_reason"] == "abort" and r.json()["sequence_end"]
    assert _kv_freed(http)


def test_ids_are_unique_in_flight_and_free_again_after(http, server):
    request_id = _id()
    with httpx.stream("POST", f"{server}/v2/models/ensemble/generate_stream", json={**LONG, "request_id": request_id},
                      timeout=60) as r:
        events = _data(r.iter_lines())
        next(events)
        twin = http.post("/v2/models/ensemble/generate", json={**LONG, "request_id": request_id})
        assert twin.status_code == 409 and twin.json()["error"].startswith("request_id"), twin.text
        assert _stop(server, "ensemble", request_id).status_code == 200
        assert list(events)[-1]["finish_reason"] == "abort"
    again = http.post("/v2/models/ensemble/generate", json={"text_input": "Hi", "max_tokens": 3,
                                                           "request_id": request_id})
    assert again.status_code == 200, again.text
    late = _stop(server, "ensemble", request_id)  # finished: nothing in flight under it
    assert late.status_code == 404 and late.json()["error"].startswith("request_id"), late.text


@pytest.mark.parametrize("body, status", [
    ({"request_id": "never-sent", "stop": True}, 404),
    ({"stop": True}, 400),
    ({"text_input": "ignored", "stop": True, "parameters": {"request_id": "never-sent"}}, 404),
])
def test_a_stop_for_no_request_in_flight_names_request_id(http, body, status):
    r = http.post("/v2/models/tensorrt_llm/generate", json=body)
    assert r.status_code == status and r.json()["error"].startswith("request_id"), r.text


@pytest.fixture(scope="module")
def two_ingress_server(server, tmp_path_factory, lora_root):
    """An app whose Ingress has two replicas: a stop request may land on either."""
    from ray import serve

    yield server + run_with_replicas(tmp_path_factory, lora_root, "ingress", 2, "two-ingress")
    serve.delete("two-ingress")


def test_a_stop_reaches_the_stream_on_another_ingress_replica(two_ingress_server):
    # Serve's proxy picks a replica for each request: over 4 streams and their stops, at least one
    # stop lands on the other replica but in 1 run of 16 (each stop is also checked on its own).
    def one(_):
        return _stopped_stream(two_ingress_server, "ensemble",
                               lambda request_id: _stop(two_ingress_server, "ensemble", request_id))

    with ThreadPoolExecutor(4) as pool:
        for events, took_s in pool.map(one, range(4)):
            _assert_ended_by_stop(events, took_s)
    with httpx.Client(base_url=two_ingress_server, timeout=60) as http:
        assert _kv_freed(http)
