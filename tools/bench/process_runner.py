"""Drive the engine in a process of its own (app/engine/engine_process.py, as a GPU Engine replica
runs it) through a workload, with no Ray: run_engine's workload and timings, over the pipe and the
asyncio streams that an Engine replica reads. Beside run_engine it shows what the process boundary
costs, apart from what Serve's hops cost."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from app.engine import SamplingParams
from app.engine.engine_process import EngineProcess
from tools.bench.report import RequestTiming, RunResult, summarize
from tools.bench.workload import Workload


def run_engine_process(engine: EngineProcess, wl: Workload, name: str) -> RunResult:
    return asyncio.run(_run(engine, wl, name))


async def _run(engine: EngineProcess, wl: Workload, name: str) -> RunResult:
    """wl.concurrency clients, each taking the workload's next request once it is due and the
    client's last one has come back: wl.round_trip_s after its last output reached this side of the
    pipe (so the pipe's way back counts too, as it does for a replica's client). TTFT counts from then."""
    if wl.adapters or wl.guide:
        raise ValueError("the engine-process runner takes plain requests (no adapters, no guide)")
    params = SamplingParams(max_tokens=wl.output_len, temperature=wl.temperature, top_p=wl.top_p,
                            ignore_eos=wl.ignore_eos)
    timings: list[RequestTiming | None] = [None] * wl.num_requests
    steps_before = engine.stats().steps
    start = time.perf_counter()
    taken = iter(range(wl.num_requests))

    async def client() -> None:
        free_since = start
        for i in taken:  # one iterator shared by every client: each request is taken once, in order
            due = start + (wl.arrivals_s[i] if wl.arrivals_s is not None else 0.0)
            arrival = max(due, free_since)
            await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
            own = replace(params, max_tokens=wl.output_lens[i]) if wl.output_lens else params
            chunks, tokens = [], 0
            async for out in engine.generate(f"bench-{i}", wl.prompts[i], own):
                chunks.append(time.perf_counter())
                tokens += sum(len(c.token_ids) for c in out.outputs)
            timings[i] = RequestTiming(ttft_s=chunks[0] - arrival, e2e_s=chunks[-1] - arrival, output_tokens=tokens,
                                       itl_s=[b - a for a, b in zip(chunks, chunks[1:])])
            free_since = chunks[-1] + wl.round_trip_s

    await asyncio.gather(*(client() for _ in range(wl.concurrency)))
    wall = time.perf_counter() - start
    extra = {"steps": engine.stats().steps - steps_before}  # the last step's message carried the idle snapshot
    result = summarize(name, wall, timings, sum(len(p) for p in wl.prompts), extra)
    result.output_lens = [t.output_tokens for t in timings]
    return result
