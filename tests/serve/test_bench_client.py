"""The load generator (tools/bench/serve_runner.py) against the live server."""
import asyncio

from tools.bench.report import stages_table, summarize
from tools.bench.serve_runner import _timed
from tools.bench.workload import synthetic


def test_ttft_stages_from_the_engines_stamps_add_up_to_the_ttft_the_client_saw(server):
    """On the Triton route every request's TTFT splits into stages from the engine's perf metrics
    (same host, same clock): each stage is non-negative and they sum to the client's TTFT."""
    workload = synthetic(6, "8:24", 6, 49152, seed=4, concurrency=3)
    _, _, timings = asyncio.run(_timed(server, "triton", "smollm2", workload, "stages"))
    for timing in timings:
        stages = timing.ttft_stages_s
        assert set(stages) == {"to engine", "queued", "first step", "to client"}
        assert min(stages.values()) > -0.002, stages  # two clocks read apart, never a stage before its start
        assert abs(sum(stages.values()) - timing.ttft_s) < 0.005, (stages, timing.ttft_s)
    result = summarize("stages", 1.0, timings, 0)
    assert result.ttft_stages_ms["first step"]["p50"] > 0
    assert "first step" in stages_table([result])
