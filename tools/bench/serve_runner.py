"""Load against a running service over HTTP: streaming requests, per-chunk timing."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
from tqdm import tqdm

from tools.bench.report import RequestTiming, RunResult, summarize
from tools.bench.workload import Workload


def _request(route: str, model: str, prompt: list[int], wl: Workload) -> tuple[str, dict]:
    if route == "openai":
        return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": wl.output_len, "temperature": 0,
                                   "ignore_eos": wl.ignore_eos, "stream": True}
    return "/v2/models/tensorrt_llm/generate_stream", {
        "input_ids": prompt, "request_output_len": wl.output_len, "exclude_input_in_output": True,
        "ignore_eos": wl.ignore_eos, "stream": True}


def _tokens_in(event: dict, route: str) -> int:
    if route == "openai":
        return 1 if any(c.get("text") for c in event.get("choices", [])) else 0  # corrected by usage below
    return len(event.get("output_ids", []))


async def _one(client: httpx.AsyncClient, route: str, model: str, prompt: list[int], wl: Workload) -> RequestTiming:
    path, body = _request(route, model, prompt, wl)
    start = time.perf_counter()
    stamps, tokens = [], 0
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            n = _tokens_in(event, route)
            if "usage" in event:
                n = event["usage"]["completion_tokens"] - tokens
            if n:
                stamps.append(time.perf_counter())
                tokens += n
    return RequestTiming(ttft_s=stamps[0] - start, e2e_s=stamps[-1] - start, output_tokens=tokens,
                         itl_s=[b - a for a, b in zip(stamps, stamps[1:])])


async def run_http(url: str, route: str, model: str, wl: Workload, name: str) -> RunResult:
    limits = httpx.Limits(max_connections=wl.concurrency + 8, max_keepalive_connections=wl.concurrency + 8)
    gate = asyncio.Semaphore(wl.concurrency)
    bar = tqdm(total=wl.num_requests, desc=name, unit="req", leave=False)

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()

        async def launch(i: int) -> RequestTiming:
            if wl.arrivals_s is not None:
                await asyncio.sleep(max(0.0, wl.arrivals_s[i] - (time.perf_counter() - start)))
            async with gate:
                timing = await _one(client, route, model, wl.prompts[i], wl)
            bar.update()
            return timing

        timings = await asyncio.gather(*(launch(i) for i in range(wl.num_requests)))
        wall = time.perf_counter() - start
    bar.close()
    return summarize(name, wall, list(timings), sum(map(len, wl.prompts)))
