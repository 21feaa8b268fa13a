"""Prometheus metrics through Ray's metrics endpoint (ray.util.metrics), named after Triton's
TensorRT-LLM metrics where one exists. Ray prefixes every name with `ray_` on export; its own
tags (application, deployment, replica) come on top of ours (model, stage).

Engine gauges are refreshed from the backend's stats by a small thread, so they move while the
loop runs and cost nothing per token. Per-request histograms are recorded by the ingress, which
sees every request end to end.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ray.util.metrics import Counter, Gauge, Histogram

TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
SECONDS_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5]

# Triton's gauge families: (metric, label key, {label value: stats key or function of stats})
ENGINE_GAUGES: list[tuple[str, str, str, dict[str, Callable[[dict], float]]]] = [
    ("nv_trt_llm_request_metrics", "request_type", "requests in the engine by state", {
        "active": lambda s: s["num_running"] + s["num_waiting"],
        "max": lambda s: s["max_batch_size"],
        "scheduled": lambda s: s["context_requests_last_step"] + s["generation_requests_last_step"],
        "context": lambda s: s["context_requests_last_step"],
        "waiting": lambda s: s["num_waiting"]}),
    ("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", "KV cache blocks", {
        "max": lambda s: s["max_blocks"], "free": lambda s: s["free_blocks"], "used": lambda s: s["used_blocks"],
        "tokens_per": lambda s: s["tokens_per_block"], "reused": lambda s: s["reused_blocks_total"],
        "fraction": lambda s: s["used_blocks"] / s["max_blocks"] if s["max_blocks"] else 0.0}),
    ("nv_trt_llm_inflight_batcher_metrics", "inflight_batcher_specific_metric", "the in-flight batcher's last step", {
        "total_context_tokens": lambda s: s["context_tokens_last_step"],
        "generation_requests": lambda s: s["generation_requests_last_step"],
        "paused_requests": lambda s: s["num_paused"]}),
]
# Running totals in the stats, exported as counters (by their increase since the last poll).
ENGINE_COUNTERS = [
    ("llm_serve_preemptions", "sequences preempted (recomputed later) under MAX_UTILIZATION",
     {"": lambda s: s["num_preempted_total"]}),
    ("llm_serve_lora_cache_events", "LoRA adapter cache events on the device",
     {e: (lambda s, e=e: s["lora"][e]) for e in ("loads", "evictions", "hits", "misses")}),
]


class EngineMetrics:
    """Polls `stats()` every `interval_s` and exports what the backend reports (a production
    backend reports fewer keys; those it lacks are skipped)."""

    def __init__(self, model: str, stats: Callable[[], dict], interval_s: float = 1.0):
        self.tags = {"model": model, "stage": "engine"}
        self.stats, self.interval_s = stats, interval_s
        self.gauges = {name: Gauge(name, description=doc, tag_keys=("model", "stage", key))
                       for name, key, doc, _ in ENGINE_GAUGES}
        self.counters = {name: Counter(name, description=doc, tag_keys=("model", "stage", "event"))
                         for name, doc, _ in ENGINE_COUNTERS}
        self.lora_resident = Gauge("llm_serve_lora_adapters", description="LoRA adapters held, by place",
                                   tag_keys=("model", "stage", "place"))
        self._last: dict[tuple[str, str], float] = {}
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="engine-metrics", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.export(self.stats())
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                pass

    def export(self, stats: dict) -> None:
        for name, key, _, values in ENGINE_GAUGES:
            for label, read in values.items():
                value = _read(read, stats)
                if value is not None:
                    self.gauges[name].set(value, {**self.tags, key: label})
        for name, _, values in ENGINE_COUNTERS:
            for event, read in values.items():
                value = _read(read, stats)
                if value is None:
                    continue
                delta = value - self._last.get((name, event), 0)
                self._last[(name, event)] = value
                if delta > 0:
                    self.counters[name].inc(delta, {**self.tags, "event": event})
        for place in ("host", "device"):
            if place in stats.get("lora", {}):
                self.lora_resident.set(len(stats["lora"][place]), {**self.tags, "place": place})

    def stop(self) -> None:
        self._stop.set()


def _read(read: Callable[[dict], float], stats: dict) -> float | None:
    try:
        return float(read(stats))
    except (KeyError, TypeError):
        return None


class IngressMetrics:
    """Per-request outcome and latency, recorded by the ingress (labels: model, stage, api)."""

    def __init__(self, model: str):
        self.tags = {"model": model, "stage": "ingress"}
        keys = ("model", "stage", "api")
        self.success = Counter("nv_inference_request_success", description="requests answered in full",
                               tag_keys=keys)
        self.failure = Counter("nv_inference_request_failure", description="requests that ended in an error",
                               tag_keys=(*keys, "status"))
        self.duration = Counter("nv_inference_request_duration_us", description="cumulative request time (us)",
                                tag_keys=keys)
        self.input_len = Histogram("nv_llm_input_token_len", description="prompt tokens per request",
                                   boundaries=TOKEN_BUCKETS, tag_keys=keys)
        self.output_len = Histogram("nv_llm_output_token_len", description="generated tokens per request",
                                    boundaries=TOKEN_BUCKETS, tag_keys=keys)
        self.ttft = Histogram("llm_serve_time_to_first_token_seconds", description="time to the first token",
                              boundaries=SECONDS_BUCKETS, tag_keys=keys)
        self.tpot = Histogram("llm_serve_time_per_output_token_seconds",
                              description="(E2E - TTFT) / (output tokens - 1)", boundaries=TPOT_BUCKETS, tag_keys=keys)
        self.e2e = Histogram("llm_serve_e2e_request_latency_seconds", description="request latency end to end",
                             boundaries=SECONDS_BUCKETS, tag_keys=keys)

    def succeeded(self, api: str, started: float, first: float | None, num_prompt: int, num_output: int) -> None:
        tags = {**self.tags, "api": api}
        now = time.monotonic()
        self.success.inc(1, tags)
        self.duration.inc((now - started) * 1e6, tags)
        self.input_len.observe(num_prompt, tags)
        self.output_len.observe(num_output, tags)
        self.e2e.observe(now - started, tags)
        if first is not None:
            self.ttft.observe(first - started, tags)
            if num_output > 1:
                self.tpot.observe((now - first) / (num_output - 1), tags)

    def failed(self, api: str, status: int) -> None:
        self.failure.inc(1, {**self.tags, "api": api, "status": str(status)})
