"""A fixed, seeded workload: prompts of token ids, output lengths and arrival times."""
from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, replace


@dataclass
class Workload:
    prompts: list[list[int]]
    output_len: int
    ignore_eos: bool
    arrivals_s: list[float] | None  # offsets from the start, or None: limited by concurrency only
    concurrency: int
    adapters: list[str | None] | None = None
    output_lens: list[int] | None = None  # per request, in place of output_len
    temperature: float = 0.0  # 0: greedy; else every request samples (unseeded), as most sampled traffic does
    top_p: float = 1.0
    guide: str | None = None  # a JSON schema (text) every request's output is held to
    # Closed loop: a finished request's slot takes its next request this long after the request
    # ended (the client's round trip through a serving path); the engine runners only (run_engine
    # counts from the step that ended it, run_engine_process from its last output's delivery).
    round_trip_s: float = 0.0

    @property
    def num_requests(self) -> int:
        return len(self.prompts)


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def run_seed(seed: int, *run: object) -> int:
    """A seed of its own for each run against one engine, from the base seed and what names the run.
    Runs that repeat prompts share their KV blocks through prefix caching: the later run's prefills
    mostly vanish and its TTFT and throughput flatter it."""
    return zlib.crc32(":".join(map(str, (seed, *run))).encode())


def fresh_prompts(wl: Workload, vocab_size: int, seed: int) -> Workload:
    """The workload with new random prompts of the same lengths: the same run on other tokens."""
    rng = random.Random(seed)
    return replace(wl, prompts=[[rng.randrange(100, vocab_size) for _ in p] for p in wl.prompts])


def synthetic(num_requests: int, input_len: str, output_len: int | str, vocab_size: int, seed: int = 0,
              ignore_eos: bool = True, concurrency: int = 16, request_rate: float | None = None,
              arrival: str = "exponential") -> Workload:
    """Random-token prompts (vllm bench's "random" dataset) with lengths uniform in input_len, and
    output lengths uniform in output_len (N or LO:HI)."""
    rng = random.Random(seed)
    lo, hi = parse_range(input_len)
    prompts = [[rng.randrange(100, vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(num_requests)]
    out_lo, out_hi = parse_range(str(output_len))
    output_lens = [rng.randint(out_lo, out_hi) for _ in range(num_requests)] if out_lo != out_hi else None
    arrivals = None
    if request_rate:
        t, arrivals = 0.0, []
        for _ in range(num_requests):
            arrivals.append(t)
            t += rng.expovariate(request_rate) if arrival == "exponential" else 1.0 / request_rate
    return Workload(prompts, out_hi, ignore_eos, arrivals, concurrency, output_lens=output_lens)
