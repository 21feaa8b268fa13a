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
    stamps = result.request_stamps_s
    assert len(stamps) == 6
    for request in stamps:
        assert all(request[a] <= request[b] + 0.002 for a, b in zip(order, order[1:])), request
        assert request["first_token"] <= request["first_seen"] + 0.002 <= request["done"] + 0.004, request
    for k in (0, 1):  # process k sent requests k, k + 2, ... in that order (its gate lets them in first come)
        sent = [request["sent"] for request in stamps[k::2]]
        assert sent == sorted(sent), sent
    assert "request_stamps_s" in result.as_dict()
    assert "request_stamps_s" not in run_load(server, "triton", "smollm2", workload, "none").as_dict()
    assert analyse(stamps)["requests"] == 6

