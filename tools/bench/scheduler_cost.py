"""What the in-flight batcher costs the engine's host a step, and how many tokens its steps carry,
with no model: the scheduler (app/engine/scheduler.py) over a real BlockManager, through a closed
loop of N streams whose finished requests are replaced (at once, or some steps later, as a serving
path's round trip delays them), each step's samples a fixed token.

    python -m tools.bench.scheduler_cost --streams 256 --requests 2048 --output-len 64:192 [--replace-after 3]

On the GPU, with mixed output lengths at 256 streams, the engine's loop keeps its core busy (docs/
PERFORMANCE.md, "The engine process's pipe on the GPU"): scheduling and updating took 17% of it, and
the steps of more than piecewise_graph_max_tokens (512) tokens, run op by op, 29%; the GPU stayed
busy 91-94% of the time ("Piecewise graphs past 512 tokens"). Prints, for each seed, schedule() and
update() ms a step and the share of steady-state steps over each --over size.
"""
from __future__ import annotations

import argparse
import collections
import random
import time
from dataclasses import dataclass

from app.engine.block_manager import BlockManager
from app.engine.config import BatchingType, SchedulerPolicy
from app.engine.sampler import SamplerOutput
from app.engine.sampling_params import SamplingParams
from app.engine.scheduler import Scheduler, SchedulerLimits
from app.engine.sequence import Sequence
from tools.bench.workload import parse_range


@dataclass
class LoopResult:
    finished: int  # requests that ended
    schedule_ms: float  # a step, on average
    update_ms: float
    step_tokens: list[int]  # each step's tokens, in order

    def share_over(self, tokens: int) -> float:
        """Of the steady state's steps (after the start's burst, 20 steps, and before the last fifth's
        tail), the share that carries more than `tokens`."""
        steady = self.step_tokens[20:len(self.step_tokens) * 4 // 5] or self.step_tokens
        return sum(n > tokens for n in steady) / len(steady)


def make_sequence(rng: random.Random, seq_id: int, prompt_len: int, output_lens: tuple[int, int]) -> Sequence:
    """A request of random prompt ids (distinct: no cached prefixes) and an output length drawn from
    output_lens, run to its max_tokens."""
    prompt = [rng.randrange(1, 120_000) for _ in range(prompt_len)]
    params = SamplingParams(max_tokens=rng.randint(*output_lens), ignore_eos=True)
    return Sequence(seq_id, f"r{seq_id}", 0, prompt, params, frozenset(), None)


def run(streams: int, requests: int, prompt_len: int, output_lens: tuple[int, int], seed: int,
        replace_after: int = 0) -> LoopResult:
    """One closed loop; a finished request's replacement is added `replace_after` steps later."""
    rng = random.Random(seed)
    limits = SchedulerLimits(streams, 2048, True, SchedulerPolicy.GUARANTEED_NO_EVICT, BatchingType.INFLIGHT)
    sched = Scheduler(limits, BlockManager(8192, 32))
    added = 0

    def add() -> None:
        nonlocal added
        sched.add(make_sequence(rng, added, prompt_len, output_lens))
        added += 1

    for _ in range(min(streams, requests)):
        add()
    due: collections.Counter = collections.Counter()  # step -> replacements to add before it
    step, finished, scheduling, updating, tokens = 0, 0, 0.0, 0.0, []
    while sched.has_work() or due:
        for _ in range(min(due.pop(step, 0), requests - added)):
            add()
        step += 1
        if not sched.has_work():  # every request in flight is on its way back
            continue
        start = time.perf_counter()
        plan = sched.schedule()
        planned = time.perf_counter()
        rows = [item.seq for item in plan.scheduled if item.samples]
        held = len(sched.running) + len(sched.waiting)
        sched.update(plan, rows, SamplerOutput([7] * len(rows), [0.0] * len(rows), {}))
        scheduling, updating = scheduling + planned - start, updating + time.perf_counter() - planned
        tokens.append(plan.num_tokens)
        ended = held - len(sched.running) - len(sched.waiting)
        finished += ended
        if ended and added < requests:
            due[step + replace_after] += ended
    return LoopResult(finished, scheduling / len(tokens) * 1e3, updating / len(tokens) * 1e3, tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--requests", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", default="64:192", help="N or LO:HI, drawn uniformly")
    p.add_argument("--replace-after", type=int, default=0, help="steps between a request's end and its replacement")
    p.add_argument("--over", type=int, nargs="*", default=[512, 1024], help="step sizes to count the steps above")
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args()
    lens = parse_range(args.output_len)
    for seed in range(args.seeds):
        r = run(args.streams, args.requests, args.prompt_len, lens, seed, args.replace_after)
        shares = ", ".join(f"over {n}: {r.share_over(n):.1%}" for n in args.over)
        print(f"seed {seed}: {len(r.step_tokens)} steps, schedule {r.schedule_ms:.3f} ms a step, "
              f"update {r.update_ms:.3f} ms a step; steady-state steps {shares}")


if __name__ == "__main__":
    main()
