"""Prometheus metrics on Ray's scrape endpoint move with load as the Triton names promise. Ray
exports them prefixed `ray_`, and counters (OpenTelemetry) with a `_total` suffix."""
import re
import threading
import time

import httpx
import ray

LINE = re.compile(r'^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')


def scrape() -> list[tuple[str, dict, float]]:
    port = ray.nodes()[0]["MetricsExportPort"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m and not line.startswith("#"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
            out.append((m["name"], labels, float(m["value"])))
    return out


def total(samples, name: str, **labels) -> float:
    return sum(v for n, ls, v in samples if n == name and all(ls.get(k) == w for k, w in labels.items()))


def wait_for(check, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = scrape()
        if check(samples):
            return samples
        time.sleep(0.5)
    raise AssertionError("the metrics did not move in time")


def test_metric_families_move_with_load(server, http):
    model = {"model": "smollm2-135m"}
    before = scrape()
    ok_before = total(before, "ray_nv_inference_request_success_total", **model)
    bad_before = total(before, "ray_nv_inference_request_failure_total", status="400", **model)
    ttft_before = total(before, "ray_llm_serve_time_to_first_token_seconds_count", **model)

    long_running = threading.Thread(target=lambda: http.post("/v2/models/ensemble/generate", json={
        "text_input": "Tell me a long story.", "max_tokens": 300, "ignore_eos": True}))
    long_running.start()
    during = wait_for(lambda s: total(s, "ray_nv_trt_llm_request_metrics", request_type="active", **model) > 0
                      and total(s, "ray_nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used", **model) > 0)
    assert total(during, "ray_nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max", **model) > 0
    assert total(during, "ray_nv_trt_llm_request_metrics", request_type="max", **model) == 64
    long_running.join()

    for i in range(3):
        assert http.post("/v2/models/ensemble/generate", json={"text_input": f"Count to {i}", "max_tokens": 8,
                                                                "lora_task_id": "sql"}).status_code == 200
    assert http.post("/v2/models/ensemble/generate", json={"text_input": "hi", "top_p": 7}).status_code == 400
    after = wait_for(lambda s: total(s, "ray_nv_inference_request_success_total", **model) >= ok_before + 4
                     and total(s, "ray_nv_inference_request_failure_total", status="400", **model) >= bad_before + 1)
    assert total(after, "ray_llm_serve_time_to_first_token_seconds_count", **model) >= ttft_before + 4
    assert total(after, "ray_nv_llm_output_token_len_sum", **model) >= 300 + 3
    assert total(after, "ray_nv_llm_input_token_len_count", **model) >= 4
    assert total(after, "ray_llm_serve_e2e_request_latency_seconds_bucket", le="+Inf", **model) >= 4
    assert total(after, "ray_nv_inference_request_duration_us_total", **model) > 0
    assert total(after, "ray_llm_serve_lora_cache_events_total", event="hits", **model) > 0
    assert total(after, "ray_llm_serve_lora_adapters", place="host", **model) >= 1
    # Idle again: nothing active, every block back (reused ones stay counted as reusable)
    idle = wait_for(lambda s: total(s, "ray_nv_trt_llm_request_metrics", request_type="active", **model) == 0)
    assert total(idle, "ray_nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used", **model) == 0
