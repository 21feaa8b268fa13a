"""What the in-flight batcher costs the engine's host a step, with no model: the scheduler
(app/engine/scheduler.py) over a real BlockManager, through a closed loop of N streams whose
finished requests are replaced at once, each step's samples a fixed token.

    python -m tools.bench.scheduler_cost --streams 256 --requests 2048 --output-len 64:192

On the GPU the engine's loop is host-bound with mixed output lengths at 256 streams (docs/
PERFORMANCE.md, "The engine process's pipe on the GPU"), and scheduling and updating took 17% of it.
Prints schedule() and update() ms a step for each seed.
"""
from __future__ import annotations

import argparse
import random
import time

from app.engine.block_manager import BlockManager
from app.engine.config import BatchingType, SchedulerPolicy
from app.engine.sampler import SamplerOutput
from app.engine.sampling_params import SamplingParams
from app.engine.scheduler import Scheduler, SchedulerLimits
from app.engine.sequence import Sequence


def run(streams: int, requests: int, prompt_len: int, output_lens: tuple[int, int],
        seed: int) -> tuple[int, int, float, float]:
    """(steps, requests finished, schedule ms a step, update ms a step) of one closed loop."""
    rng = random.Random(seed)
    limits = SchedulerLimits(streams, 2048, True, SchedulerPolicy.GUARANTEED_NO_EVICT, BatchingType.INFLIGHT)
    sched = Scheduler(limits, BlockManager(8192, 32))
    added = 0

    def add() -> None:
        nonlocal added
        prompt = [rng.randrange(1, 120_000) for _ in range(prompt_len)]  # distinct: no cached prefixes
        params = SamplingParams(max_tokens=rng.randint(*output_lens), ignore_eos=True)
        sched.add(Sequence(added, f"r{added}", 0, prompt, params, frozenset(), None))
        added += 1

    for _ in range(min(streams, requests)):
        add()
    steps, finished, scheduling, updating = 0, 0, 0.0, 0.0
    while sched.has_work():
        start = time.perf_counter()
        plan = sched.schedule()
        planned = time.perf_counter()
        rows = [item.seq for item in plan.scheduled if item.samples]
        held = len(sched.running) + len(sched.waiting)
        sched.update(plan, rows, SamplerOutput([7] * len(rows), [0.0] * len(rows), {}))
        scheduling, updating, steps = scheduling + planned - start, updating + time.perf_counter() - planned, steps + 1
        ended = held - len(sched.running) - len(sched.waiting)
        finished += ended
        for _ in range(min(ended, requests - added)):  # each finished one's replacement
            add()
    return steps, finished, scheduling / steps * 1e3, updating / steps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--requests", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", default="64:192", help="LO:HI, drawn uniformly")
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args()
    lo, hi = (int(x) for x in args.output_len.split(":"))
    for seed in range(args.seeds):
        steps, _, schedule_ms, update_ms = run(args.streams, args.requests, args.prompt_len, (lo, hi), seed)
        print(f"seed {seed}: {steps} steps, schedule {schedule_ms:.3f} ms a step, update {update_ms:.3f} ms a step")


if __name__ == "__main__":
    main()
