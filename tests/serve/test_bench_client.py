"""The load generator (tools/bench/serve_runner.py) against the live server."""
import asyncio

from tools.bench.report import stages_table, summarize
from tools.bench.serve_runner import _timed
from tools.bench.workload import synthetic


def test_ttft_stages_from_the_engines_stamps_are_in_order(server):
    """On the Triton route every request's TTFT splits into stages from the engine's perf metrics
    (same host, same clock): every request has them, and no stage ends before it starts, so the
    client's and the engine's stamps come in the order the request passed them. (The stages sum to
    the client's wall-clock TTFT by construction; against its monotonic one, that checks the clocks.)"""
    workload = synthetic(6, "8:24", 6, 49152, seed=4, concurrency=3)
    _, _, timings = asyncio.run(_timed(server, "triton", "smollm2", workload, "stages"))
    for timing in timings:
        stages = timing.ttft_stages_s
        assert set(stages) == {"to engine", "queued", "first step", "to client"}
        assert min(stages.values()) > -0.002, stages  # two clocks read apart, never a stage before its start
        assert abs(sum(stages.values()) - timing.ttft_s) < 0.005, (stages, timing.ttft_s)
    result = summarize("stages", 1.0, timings, 0)
    assert result.ttft_stages_requests == len(timings) and result.ttft_stages_ms["first step"]["p50"] > 0
    assert "(6/6)" in stages_table([result])


def test_no_benchmark_run_reuses_another_runs_prompts(server):
    """Runs against one server never share prompts: not the levels of one command, not the routes of
    two. A repeated prompt would find its KV blocks cached and flatter the later run (a 256-stream
    level on a second route once read 1.1x the bare engine that way)."""
    from tests.serve.test_metrics import scrape, total, wait_for
    from tools.benchmark import main

    model = {"model": "smollm2-135m"}
    done = total(scrape(), "ray_nv_inference_request_success_total", **model)
    reused = total(scrape(), "ray_nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="reused", **model)
    for route in ("triton", "openai"):  # 40-token prompts: a full 32-token block each, cacheable
        main(["serve", "--url", server, "--config", "configs/smollm2-135m.yaml", "--route", route,
              "--concurrency", "1", "2", "--num-requests", "2", "4", "--input-len", "40", "--output-len", "2"])
    # 2 routes x 2 levels x (2 warm-ups + the level's requests), then the engine idle again
    idle = wait_for(lambda s: total(s, "ray_nv_inference_request_success_total", **model) >= done + 20
                    and total(s, "ray_nv_trt_llm_request_metrics", request_type="active", **model) == 0)
    assert total(idle, "ray_nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="reused", **model) == reused
