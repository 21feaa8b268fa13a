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


class _Slots:
    """The workload's slots (wl.concurrency): when each free one came free, and when those whose
    request has ended come back (round_trip_s after the step that ended it; at once without one)."""

    def __init__(self, count: int, start: float, round_trip_s: float):
        self.free = deque([start] * count)
        self.returning: deque[float] = deque()
        self.round_trip_s = round_trip_s

    def release(self, ended: float) -> None:
        self.returning.append(ended + self.round_trip_s)

    def collect(self, now: float) -> None:
        while self.returning and self.returning[0] <= now:
            self.free.append(self.returning.popleft())

    def next_event(self, wl: Workload, next_i: int, start: float) -> float | None:
        """When (seconds from the start) the loop next has a request to take: one due in a free
        slot, or a slot coming back; None when none is (every request taken, or every slot held)."""
        if next_i >= wl.num_requests:
            return None
        if self.free and wl.arrivals_s is not None:
            return wl.arrivals_s[next_i]
        return self.returning[0] - start if self.returning else None


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
    slots = _Slots(wl.concurrency, start, wl.round_trip_s)
    next_i = 0
    while next_i < wl.num_requests or engine.has_unfinished_requests():
        slots.collect(time.perf_counter())
        now = time.perf_counter() - start
        while next_i < wl.num_requests and slots.free and (wl.arrivals_s is None or wl.arrivals_s[next_i] <= now):
            rid = f"bench-{next_i}"
            adapter = wl.adapters[next_i] if wl.adapters else None
            own = replace(params, max_tokens=wl.output_lens[next_i]) if wl.output_lens else params
            engine.add_request(rid, wl.prompts[next_i], own, adapter_id=adapter)
            due = start + wl.arrivals_s[next_i] if wl.arrivals_s is not None else start
            arrived[rid] = max(due, slots.free.popleft())
            next_i += 1
        upcoming = slots.next_event(wl, next_i, start)
        if not engine.has_unfinished_requests():
            if upcoming is None:  # requests left, none in the engine, no slot free or coming back
                raise RuntimeError("a request left the engine without a finished output: its slot never came back")
            time.sleep(max(0.0, upcoming - (time.perf_counter() - start)))
            continue
        wait = engine.seconds_to_plan()  # as the serving loops do: take arrivals until the step computing nearly ends
        if wait > 0:
            time.sleep(max(0.0, wait if upcoming is None else min(wait, upcoming - now)))
            continue
        before = time.perf_counter()
        outputs = engine.step()
        t = time.perf_counter()
        for out in outputs:
            chunks.setdefault(out.request_id, []).append(t)
            tokens[out.request_id] = tokens.get(out.request_id, 0) + sum(len(c.token_ids) for c in out.outputs)
            if out.finished:
                slots.release(t)
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
