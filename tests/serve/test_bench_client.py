"""The load generator (tools/bench/serve_runner.py) against the live server."""
import asyncio

import pytest

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
    two commands (each draws its own seed unless given one). A repeated prompt would find its KV
    blocks cached and flatter the later run (a 256-stream level on a second route once read 1.1x
    the bare engine that way). The engine's block counters are read from the replica itself."""
    from ray import serve

    from tools.benchmark import main

    engine = serve.get_deployment_handle("Engine", app_name="llm")
    before = engine.stats.remote().result()
    for route in ("triton", "openai"):  # 40-token prompts: a full 32-token block each, cacheable
        main(["serve", "--url", server, "--config", "configs/smollm2-135m.yaml", "--route", route,
              "--concurrency", "1", "2", "--num-requests", "2", "4", "--input-len", "40", "--output-len", "2"])
    after = engine.stats.remote().result()
    assert after["new_blocks_total"] >= before["new_blocks_total"] + 12  # the runs' prompts were there
    assert after["reused_blocks_total"] == before["reused_blocks_total"]


def test_the_guided_benchmark_holds_requests_to_its_schema_on_both_routes(server, tmp_path):
    """`serve --guided` sends the schema on each route (answers end with their object, short of
    the token budget that ignore_eos would otherwise fill), then the free run at exactly the guided
    answers' lengths."""
    import json

    from tools.benchmark import main

    main(["serve", "--url", server, "--config", "configs/smollm2-135m.yaml", "--route", "openai", "--guided",
          "--concurrency", "2", "--num-requests", "3", "--input-len", "16", "--output-len", "400", "--ignore-eos",
          "--json", str(tmp_path / "openai.json")])
    main(["serve", "--url", server, "--config", "configs/smollm2-135m.yaml", "--route", "triton", "--guided",
          "--concurrency", "2", "--num-requests", "3", "--input-len", "16", "--output-len", "400", "--ignore-eos",
          "--json", str(tmp_path / "triton.json")])
    for route in ("openai", "triton"):
        free, guided = json.loads((tmp_path / f"{route}.json").read_text())["results"]
        assert "guided" in guided["name"] and "free" in free["name"]
        assert 0 < guided["output_tokens"] < 3 * 400 and free["output_tokens"] == guided["output_tokens"], (free, guided)


def test_lengths_come_back_in_request_order_from_several_client_processes(server):
    """Split over client processes (request i to process i mod P), a run's per-request lengths
    still come back in request order: the guided benchmark's free run gives each request the
    length of the guided answer to the same request."""
    from dataclasses import replace

    from tools.bench.serve_runner import run_load

    workload = replace(synthetic(6, "8", 4, 49152, seed=5, ignore_eos=True, concurrency=2),
                       output_lens=[1, 6, 2, 5, 3, 4])
    assert run_load(server, "triton", "smollm2", workload, "order", processes=2).output_lens == [1, 6, 2, 5, 3, 4]


def test_a_run_keeps_each_requests_stamps_in_the_order_the_request_passed_them(server):
    """With `stamps`, a run from two client processes keeps one set of wall-clock stamps per request:
    the client's send, the engine's arrival, scheduling, first and last tokens, the client's first
    token and end, in that order (one host, one clock). tools/bench/arrivals.py reads them."""
    from tools.bench.arrivals import analyse
    from tools.bench.serve_runner import run_load

    workload = synthetic(6, "8:24", 5, 49152, seed=6, ignore_eos=True, concurrency=3)
    result = run_load(server, "triton", "smollm2", workload, "stamps", processes=2, stamps=True)
    order = ["sent", "arrival", "first_scheduled", "first_token", "last_token", "done"]
    assert len(result.request_stamps_s) == 6
    for stamps in result.request_stamps_s:
        assert all(stamps[a] <= stamps[b] + 0.002 for a, b in zip(order, order[1:])), stamps
        assert stamps["first_token"] <= stamps["first_seen"] + 0.002 <= stamps["done"] + 0.004, stamps
    assert "request_stamps_s" in result.as_dict()
    assert "request_stamps_s" not in run_load(server, "triton", "smollm2", workload, "none").as_dict()
    report = analyse(result.request_stamps_s)
    assert report["requests"] == 6 and sum(report["steps that passed a request by"].values()) == 6


def test_arrivals_split_a_wait_into_the_step_in_progress_and_the_steps_that_passed_it_by():
    """Requests a step scheduled share its stamp. One that arrived before a step which took only
    others was passed by it: its wait splits into the time until that step began and the rest."""
    from tools.bench.arrivals import analyse, step_timeline

    def request(arrival, scheduled):
        return {"sent": arrival - 0.01, "arrival": arrival, "first_scheduled": scheduled, "first_token": scheduled + 0.1,
                "last_token": scheduled + 0.5, "first_seen": scheduled + 0.11, "done": scheduled + 0.52}

    # Steps at 1.0 (takes A, B) and 2.0 (takes C, D): C came at 0.5 and waited behind the first.
    stamps = [request(0.8, 1.0), request(0.9, 1.0), request(0.5, 2.0), request(1.5, 2.0), None]
    report = analyse(stamps, bin_ms=1000)
    assert report["requests"] == 4 and report["steps that took new requests"] == 2
    assert report["steps that passed a request by"] == {0: 3, 1: 1}
    assert report["new requests a step took"]["p50"] == 2
    assert report["  until the next step began"]["mean"] == pytest.approx((200 + 100 + 500 + 500) / 4)
    assert report["  left behind after that"]["mean"] == pytest.approx(1000 / 4)
    assert report["way in ms (sent -> Engine)"]["p50"] == pytest.approx(10)
    assert report["arrivals a 1000 ms bin"]["busiest"] == 3  # 0.5, 0.8 and 0.9 in the first second
    assert step_timeline(stamps) == [{"at ms": 500.0, "took": 2, "left waiting": 1, "arrived since the last": 0},
                                     {"at ms": 1500.0, "took": 2, "left waiting": 0, "arrived since the last": 1}]
