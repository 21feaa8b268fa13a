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
