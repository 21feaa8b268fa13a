"""Drive our engine in-process (no Ray) through a workload, recording per-request timings."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from app.engine import EngineConfig, LLMEngine, SamplingParams
from app.engine.guided import Guide
from tools.bench.report import RequestTiming, RunResult, summarize
from tools.bench.workload import Workload


def run_engine(engine: LLMEngine, wl: Workload, name: str = "ours",
               on_step: Callable[[float, float, int, list], None] | None = None) -> RunResult:
    """Each request's TTFT and latency count from its arrival: when the workload says it is due, or,
    if every slot (wl.concurrency) was taken then, when a slot came free: at the end of the step
    that finished a request, plus wl.round_trip_s (a client that sends its next request once the
    last token has reached it, over a serving path that takes that long both ways). A request due
    while a step computes waits for that step (as it would in the serving engine's inbox), and that
    wait counts. on_step(started, took, added, outputs) after every step: its start (seconds from
    the run's start), its duration, how many requests were added by then, and its outputs."""
    guide = Guide("json_schema", wl.guide, "bench") if wl.guide else None
    params = SamplingParams(max_tokens=wl.output_len, temperature=wl.temperature, top_p=wl.top_p,
                            ignore_eos=wl.ignore_eos, guide=guide)
    arrived: dict[str, float] = {}
    chunks: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}
    steps_before = engine.num_steps
    queued_before = (engine.clock.queued, engine.clock.queued_late) if engine.clock is not None else (0, 0)
    start = time.perf_counter()
    free_slots = deque([start] * wl.concurrency)  # when each free slot came free
    returning: deque[float] = deque()  # slots whose next request is still on its way back
    next_i = 0
    while next_i < wl.num_requests or engine.has_unfinished_requests():
        while returning and returning[0] <= time.perf_counter():
            free_slots.append(returning.popleft())
        now = time.perf_counter() - start
        while next_i < wl.num_requests and free_slots and (wl.arrivals_s is None or wl.arrivals_s[next_i] <= now):
            rid = f"bench-{next_i}"
            adapter = wl.adapters[next_i] if wl.adapters else None
            own = replace(params, max_tokens=wl.output_lens[next_i]) if wl.output_lens else params
            engine.add_request(rid, wl.prompts[next_i], own, adapter_id=adapter)
            due = start + wl.arrivals_s[next_i] if wl.arrivals_s is not None else start
            arrived[rid] = max(due, free_slots.popleft())
            next_i += 1
        # When the loop has something to take next: a request due in a free slot, or a slot coming back.
        upcoming = [returning[0] - start] if returning else []
        if next_i < wl.num_requests and free_slots and wl.arrivals_s is not None:
            upcoming.append(wl.arrivals_s[next_i])
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(upcoming) - (time.perf_counter() - start)))
            continue
        wait = engine.seconds_to_plan()  # as the serving loops do: take arrivals until the step computing nearly ends
        if wait > 0:
            time.sleep(max(0.0, min([wait, *(u - now for u in upcoming)])))
            continue
        before = time.perf_counter()
        outputs = engine.step()
        t = time.perf_counter()
        for out in outputs:
            chunks.setdefault(out.request_id, []).append(t)
            tokens[out.request_id] = tokens.get(out.request_id, 0) + sum(len(c.token_ids) for c in out.outputs)
            if out.finished:
                (returning if wl.round_trip_s else free_slots).append(t + wl.round_trip_s)
        if on_step is not None:
            on_step(before - start, t - before, next_i, outputs)
    wall = time.perf_counter() - start
    timings = [RequestTiming(ttft_s=chunks[rid][0] - arrived[rid], e2e_s=chunks[rid][-1] - arrived[rid],
                             output_tokens=tokens[rid], itl_s=[b - a for a, b in zip(chunks[rid], chunks[rid][1:])])
               for rid in arrived]
    stats = engine.stats()
    extra = {"steps": engine.num_steps - steps_before, "preemptions": stats.num_preempted_total,
             "kv_hit_rate": stats.kv_cache_hit_rate, "kv_pool_tokens": engine.limits.max_cache_tokens}
    if engine.clock is not None and engine.clock.queued > queued_before[0]:  # late planning: did the device wait?
        extra.update(queued_behind=engine.clock.queued - queued_before[0],
                     queued_late=engine.clock.queued_late - queued_before[1],
                     step_estimates_ms={n: round(s * 1e3, 2) for n, s in engine.clock.estimates.items()})  # at the run's end
    result = summarize(name, wall, timings, sum(len(p) for p in wl.prompts), extra)
    result.output_lens = [tokens[rid] for rid in arrived]
    return result


def add_wave_arguments(p) -> None:
    """The engine and workload of the tools that run waves of one shape on one engine (bursts, spread)."""
    p.add_argument("--model", default="configs/shapes/llama-3.1-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", default="128")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--kv-tokens", type=int, default=262144)


def wave_engine_config(args, max_batch_size: int, **options) -> EngineConfig:
    return EngineConfig(model=args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                        max_batch_size=max_batch_size, max_num_tokens=args.max_num_tokens,
                        kv_cache_config={"max_tokens": args.kv_tokens, "tokens_per_block": 32}, **options)
