"""The engine's closed loop in time, without a device: the real in-flight batcher (app/engine/
scheduler.py over a BlockManager) planned as the overlap scheduler plans it, each step lasting what
a linear model of the device says, each finished request's replacement arriving a round trip after
the step that ended it. Prints TTFT, TPOT and tok/s for each round trip.

    python -m tools.bench.closed_loop --round-trip-ms 0 10 20 40 [--output-len 64:192] [--plan-lead-ms 5]

What it is for: the TTFT a serving path adds to a closed loop at many streams comes mostly from the
engine's queue, not from the path (docs/PERFORMANCE.md, "What the round trip costs a closed loop").
With a step model of a device it predicts, in seconds on a CPU, what a round trip or a change to
the scheduler does there. The default model is the H200's on the Llama-3.1-8B shape in bf16: a step
takes 7 ms, plus 0.012 ms a row, plus 0.022 ms a prompt token (a decode step of 256 rows: 10 ms; 180
decodes beside 1,792 prompt tokens: 49 ms; 8,192 prompt tokens: 190 ms, as measured there). It has no
host: a step past the piecewise graphs, which the host queues op by op, may take longer than the
device needs (docs/PERFORMANCE.md, "A model of the closed loop").

Timing (the overlap scheduler, app/engine/llm_engine.py): step k + 1 is planned when step k - 1 has
been read back, which is when step k starts computing, with the requests that have arrived by then;
it starts when step k ends. With --plan-lead-ms (late_planning) it is planned that long before step k
ends instead. A request's first token is known when the step that sampled it ends.
"""
from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections import deque
from dataclasses import dataclass

from app.engine.block_manager import BlockManager
from app.engine.config import BatchingType, SchedulerPolicy
from app.engine.sampler import SamplerOutput
from app.engine.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from tools.bench.scheduler_cost import make_sequence
from tools.bench.workload import parse_range


@dataclass(frozen=True)
class StepModel:
    """A step's device time: base + per_row x rows + per_prompt_token x prompt tokens, in ms."""
    base_ms: float = 7.0
    per_row_ms: float = 0.012
    per_prompt_token_ms: float = 0.022

    def __call__(self, plan: SchedulerOutput) -> float:
        prompt_tokens = sum(item.num_tokens for item in plan.scheduled if not item.is_decode)
        return self.base_ms + self.per_row_ms * len(plan.scheduled) + self.per_prompt_token_ms * prompt_tokens


@dataclass
class LoopTimes:
    ttft_ms: list[float]
    tpot_ms: list[float]
    output_tokens: int
    wall_ms: float
    steps: int

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_ms * 1e3


def run(streams: int, requests: int, prompt_len: int, output_lens: tuple[int, int], round_trip_ms: float,
        step_model: StepModel = StepModel(), max_num_tokens: int = 2048, plan_lead_ms: float | None = None,
        seed: int = 0) -> LoopTimes:
    rng = random.Random(seed)
    limits = SchedulerLimits(streams, max_num_tokens, True, SchedulerPolicy.GUARANTEED_NO_EVICT, BatchingType.INFLIGHT)
    # Room for every stream's longest request twice over: the pool never holds admission back (nor did
    # the 8B configs' 262,144 tokens at 256 streams of 128/128).
    sched = Scheduler(limits, BlockManager(2 * streams * (prompt_len + output_lens[1]) // 32 + 1, 32))
    arrived: list[float] = []  # by request id
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    read: dict[int, int] = {}  # tokens read back, by request id
    ended: list[int] = []  # request ids, once their last token is read back
    returning: list[float] = []  # when replacements arrive, a heap
    in_flight: deque[tuple[SchedulerOutput, list, float]] = deque()  # launched steps: plan, rows, end

    def arrive(at: float) -> None:
        sched.add(make_sequence(rng, len(arrived), prompt_len, output_lens))
        arrived.append(at)

    def read_back(now: float) -> None:
        while in_flight and in_flight[0][2] <= now:
            plan, rows, end = in_flight.popleft()
            sched.update(plan, rows, SamplerOutput([7] * len(rows), [0.0] * len(rows), {}))
            for seq in rows:
                first.setdefault(seq.seq_id, end)
                last[seq.seq_id] = end
                read[seq.seq_id] = read.get(seq.seq_id, 0) + 1
                # A sequence leaves the scheduler when its last step is launched; its client sees
                # the end when that step is read back.
                if seq.is_finished and read[seq.seq_id] == seq.num_output_tokens:
                    ended.append(seq.seq_id)
                    if len(arrived) + len(returning) < requests:
                        heapq.heappush(returning, end + round_trip_ms)

    for _ in range(min(streams, requests)):
        arrive(0.0)
    now, device_free, steps = 0.0, 0.0, 0
    while True:
        read_back(now)
        while returning and returning[0] <= now:
            arrive(heapq.heappop(returning))
        plan = sched.schedule() if sched.has_work() else None
        if plan is None or plan.is_empty:  # wait for the device, or for an arrival
            if in_flight or returning:
                now = in_flight[0][2] if in_flight else returning[0]
                continue
            break
        rows = [item.seq for item in plan.scheduled if item.samples]
        sched.update(plan, rows, None)  # launched: placeholders, as the overlapped engine does
        start = max(now, device_free)
        device_free = start + step_model(plan)
        in_flight.append((plan, rows, device_free))
        steps += 1
        now = start if plan_lead_ms is None else max(start, device_free - plan_lead_ms)
    ttft = [first[i] - arrived[i] for i in first]
    tpot = [(last[i] - first[i]) / (read[i] - 1) for i in ended if read[i] > 1]
    return LoopTimes(ttft, tpot, sum(read[i] for i in ended), max(last.values()), steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", default="128", help="N or LO:HI, drawn uniformly")
    p.add_argument("--round-trip-ms", type=float, nargs="+", default=[0.0, 10.0, 20.0, 40.0])
    p.add_argument("--max-num-tokens", type=int, default=1024, help="the 8B configs' (the step model holds for any)")
    p.add_argument("--plan-lead-ms", type=float, default=None, help="plan each step this long before the one "
                   "computing ends (late_planning); default: when it starts")
    p.add_argument("--step-ms", type=float, nargs=3, default=None, metavar=("BASE", "PER_ROW", "PER_PROMPT_TOKEN"),
                   help="the step model (default: the H200's, 8B shape, bf16)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    lens = parse_range(args.output_len)
    model = StepModel(*args.step_ms) if args.step_ms else StepModel()
    print("round trip ms  TTFT p50 ms  TTFT p99 ms  TPOT p50 ms    tok/s  steps")
    for rt in args.round_trip_ms:
        r = run(args.streams, args.requests, args.prompt_len, lens, rt, model, args.max_num_tokens,
                args.plan_lead_ms, args.seed)
        p99 = statistics.quantiles(r.ttft_ms, n=100)[98]
        print(f"{rt:13g}  {statistics.median(r.ttft_ms):11.1f}  {p99:11.1f}  {statistics.median(r.tpot_ms):11.1f}"
              f"  {r.tok_s:7.0f}  {r.steps:5d}")


if __name__ == "__main__":
    main()
