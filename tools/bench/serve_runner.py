"""Load against a running service over HTTP: streaming requests, per-chunk timing.

One client process parses every streamed event of every request; at engine speed (thousands of
tokens a second over hundreds of streams) that process can become the bound. `run_load(...,
processes=P)` spreads one level over P processes (request i goes to process i mod P, concurrency
split evenly), starts them together behind a barrier and merges their timings into one result, so
running the same level with P and 2P processes shows whether the client limits the total.

On the Triton route each request asks for the engine's perf metrics, whose wall-clock stamps split
its TTFT into stages (our torch engine stamps with time.time_ns(); other backends' clocks may not
be the epoch, and the client must share the server's clock, i.e. run on its host):
- to engine: from the client starting the request (its own send included) through the proxy,
  Ingress, Tokenizer and Detokenizer hops until the Engine replica takes it (arrival);
- queued: to the engine process and its scheduler, until a step first takes it;
- first step: until its first token is read back on the host; under the overlap scheduler that
  spans the step in flight when it was scheduled, its own step, and the host's launch of the next;
- to client: from there through the Detokenizer, Ingress and proxy to the client.
Requests without every stamp (one cut short by a stop string before the engine's last event) have
no stages; a run reports how many do.
"""
from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import os
import queue
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
from tqdm import tqdm

from tools.bench.report import RequestTiming, RunResult, summarize
from tools.bench.workload import Workload

MARK_START_ENV = "BENCH_MARK_START"  # a file to touch when a measured run starts

# The engine's perf-metric stamps (<stage>_time_ns, wall clock) a request's final event carries.
ENGINE_STAMPS = ("arrival", "first_scheduled", "first_token", "last_token")


def _request(route: str, model: str, prompt: list[int], max_tokens: int, wl: Workload) -> tuple[str, dict]:
    if route == "openai":
        guide = {"response_format": {"type": "json_schema", "json_schema": {
            "name": "bench", "schema": _schema(wl.guide)}}} if wl.guide else {}
        return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                   "temperature": wl.temperature, "top_p": wl.top_p,
                                   "ignore_eos": wl.ignore_eos, "stream": True,
                                   "stream_options": {"include_usage": True}, **guide}
    guide = {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": wl.guide} if wl.guide else {}
    return "/v2/models/tensorrt_llm/generate_stream", {
        "input_ids": prompt, "request_output_len": max_tokens, "exclude_input_in_output": True,
        "temperature": wl.temperature, "runtime_top_p": wl.top_p, "ignore_eos": wl.ignore_eos, "stream": True,
        "return_perf_metrics": True, **guide}


@functools.lru_cache(maxsize=4)
def _schema(text: str) -> dict:
    return json.loads(text)


def _tokens_in(event: dict, route: str) -> int:
    if route == "openai":
        return 1 if any(c.get("text") for c in event.get("choices", [])) else 0  # corrected by usage below
    return len(event.get("output_ids", []))


async def _one(session: aiohttp.ClientSession, url: str, route: str, model: str, prompt: list[int],
               max_tokens: int, wl: Workload) -> RequestTiming:
    path, body = _request(route, model, prompt, max_tokens, wl)
    start, sent = time.perf_counter(), time.time()
    stamps, tokens, first, perf = [], 0, 0.0, None
    async with session.post(url + path, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:200]!r}")
        async for line in response.content:  # one SSE line at a time
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            n = _tokens_in(event, route)
            if event.get("usage"):  # the stream's own chunk after the last (null in the others)
                n = event["usage"]["completion_tokens"] - tokens
                if not event.get("choices") and stamps:  # the tokens it counts came with the chunks before
                    tokens += n
                    continue
            if n:
                stamps.append(time.perf_counter())
                first = first or time.time()
                tokens += n
            if "first_token_time_ns" in event:  # the last event's perf metrics
                perf = event
    wall = _wall_stamps(sent, first, time.time(), perf)
    return RequestTiming(ttft_s=stamps[0] - start, e2e_s=stamps[-1] - start, output_tokens=tokens,
                         itl_s=[b - a for a, b in zip(stamps, stamps[1:])], ttft_stages_s=_ttft_stages(wall),
                         wall_stamps_s=wall)


def _wall_stamps(sent: float, first: float, done: float, perf: dict | None) -> dict[str, float] | None:
    """A request's life on the wall clock (epoch seconds): the client's stamps and the engine's (0 where
    the engine never set one); None without the engine's perf metrics."""
    if not perf:
        return None
    engine = {stage: perf.get(f"{stage}_time_ns", 0) / 1e9 for stage in ENGINE_STAMPS}
    return {"sent": sent, **engine, "first_seen": first, "done": done}


def _ttft_stages(wall: dict[str, float] | None) -> dict[str, float] | None:
    """Where a request's TTFT went, in seconds, from its wall-clock stamps; None where a stamp is
    missing (0: never scheduled, no token)."""
    if not wall or not all(wall[key] for key in ("first_seen", "arrival", "first_scheduled", "first_token")):
        return None
    return {"to engine": wall["arrival"] - wall["sent"], "queued": wall["first_scheduled"] - wall["arrival"],
            "first step": wall["first_token"] - wall["first_scheduled"],
            "to client": wall["first_seen"] - wall["first_token"]}


def _result(name: str, wall_s: float, timings: list[RequestTiming], wl: Workload, stamps: bool) -> RunResult:
    result = summarize(name, wall_s, timings, sum(map(len, wl.prompts)))
    result.output_lens = [t.output_tokens for t in timings]
    if stamps:
        result.request_stamps_s = [t.wall_stamps_s for t in timings]
    return result


async def run_http(url: str, route: str, model: str, wl: Workload, name: str, stamps: bool = False,
                   mark_start: bool = False) -> RunResult:
    """One level of load from this process. `stamps`: the result keeps each request's wall-clock stamps
    (Triton route; tools/bench/arrivals.py reads them). `mark_start`: touch $BENCH_MARK_START, if set,
    as the load starts (a warm-up does not)."""
    start, end, timings = await _timed(url, route, model, wl, name, mark_start=mark_start)
    return _result(name, end - start, timings, wl, stamps)


def run_load(url: str, route: str, model: str, wl: Workload, name: str, processes: int = 1,
             stamps: bool = False) -> RunResult:
    """One level of load from `processes` client processes; wall time from their common start to the
    last one's end."""
    if processes <= 1:
        return asyncio.run(run_http(url, route, model, wl, name, stamps, mark_start=True))
    processes = min(processes, wl.concurrency, wl.num_requests)
    ctx = multiprocessing.get_context("spawn")  # no fork of a parent that may hold CUDA or threads
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    workers = [ctx.Process(target=_client_process, args=(url, route, model, _slice(wl, k, processes), name,
                                                         barrier, results, k), daemon=True)
               for k in range(processes)]
    for w in workers:
        w.start()
    parts = []
    while len(parts) < processes:
        try:
            parts.append(results.get(timeout=5))
        except queue.Empty:
            if not any(w.is_alive() for w in workers) and results.empty():
                parts.append(f"{processes - len(parts)} client process(es) died without a result")
                break
    for w in workers:
        w.join()
    failed = [p for p in parts if isinstance(p, str)]
    if failed:
        raise RuntimeError(f"a client process failed: {failed[0]}")
    timings = [None] * wl.num_requests  # request order: process k ran requests k, k + processes, ...
    for k, _, _, ts in parts:
        timings[k::processes] = ts
    result = _result(name, max(e for _, _, e, _ in parts) - min(s for _, s, _, _ in parts), timings, wl, stamps)
    result.extra = {"client_processes": processes}
    return result


def _slice(wl: Workload, k: int, processes: int) -> Workload:
    pick = range(k, wl.num_requests, processes)
    return replace(wl, prompts=[wl.prompts[i] for i in pick],
                   arrivals_s=None if wl.arrivals_s is None else [wl.arrivals_s[i] for i in pick],
                   adapters=None if wl.adapters is None else [wl.adapters[i] for i in pick],
                   output_lens=None if wl.output_lens is None else [wl.output_lens[i] for i in pick],
                   concurrency=wl.concurrency // processes + (k < wl.concurrency % processes))


def _client_process(url, route, model, wl, name, barrier, results, k) -> None:
    try:
        results.put((k, *asyncio.run(_timed(url, route, model, wl, name, barrier, mark_start=k == 0))))
    except BaseException as exc:  # the parent waits for one item per process
        results.put(f"{type(exc).__name__}: {exc}")


async def _timed(url: str, route: str, model: str, wl: Workload, name: str, barrier=None,
                 mark_start: bool = False) -> tuple[float, float, list[RequestTiming]]:
    """Run a workload; (start, end, timings) on the host's monotonic clock, which all processes share."""
    gate = asyncio.Semaphore(wl.concurrency)
    bar = tqdm(total=wl.num_requests, desc=name, unit="req", leave=False, disable=barrier is not None)
    # aiohttp, not httpx: httpx's connection pool scans every connection on each request event, which
    # at 256 streams made one client process busier than any stage of the app it measured.
    # A stream may run long: the limits are on connecting and on each read, not the whole request.
    connector = aiohttp.TCPConnector(limit=wl.concurrency + 8)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    base = url.rstrip("/")
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20) as client:
        if barrier is not None:
            await asyncio.to_thread(barrier.wait, 300)  # all connected, or BrokenBarrierError for all
        start = time.perf_counter()
        if mark_start and os.environ.get(MARK_START_ENV):  # a profiler waits for it (tools/gpu/serve_bench.sh)
            Path(os.environ[MARK_START_ENV]).touch()

        async def launch(i: int) -> RequestTiming:
            if wl.arrivals_s is not None:
                await asyncio.sleep(max(0.0, wl.arrivals_s[i] - (time.perf_counter() - start)))
            async with gate:
                own = wl.adapters[i] if wl.adapters and wl.adapters[i] else model  # /v1 routes by model name
                max_tokens = wl.output_lens[i] if wl.output_lens else wl.output_len
                timing = await _one(client, base, route, own, wl.prompts[i], max_tokens, wl)
            bar.update()
            return timing

        timings = await asyncio.gather(*(launch(i) for i in range(wl.num_requests)))
        end = time.perf_counter()
    bar.close()
    return start, end, list(timings)
