"""Per-request timings to the numbers everyone quotes (vllm bench / benchmark_core_model style)."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class RequestTiming:
    ttft_s: float
    e2e_s: float
    output_tokens: int
    itl_s: list[float]  # gaps between successive chunks
    ttft_stages_s: dict[str, float] | None = None  # TTFT split by stage (serve_runner, Triton route)
    wall_stamps_s: dict[str, float] | None = None  # the request's life on the wall clock (serve_runner)

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class RunResult:
    name: str
    wall_s: float
    num_requests: int
    output_tokens: int
    input_tokens: int
    ttft_ms: dict | None = None
    tpot_ms: dict | None = None
    itl_ms: dict | None = None
    e2e_ms: dict | None = None
    extra: dict | None = None
    ttft_stages_ms: dict | None = None  # stage -> percentiles over the requests that reported stages
    ttft_stages_requests: int = 0  # how many did
    output_lens: list[int] | None = field(default=None, repr=False)  # per request (not reported)
    request_stamps_s: list[dict | None] | None = field(default=None, repr=False)  # per request, when asked

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def requests_s(self) -> float:
        return self.num_requests / self.wall_s

    def as_dict(self) -> dict:
        fields = {k: v for k, v in asdict(self).items()
                  if k != "output_lens" and not (k == "request_stamps_s" and v is None)}
        return {**fields, "output_tok_s": self.output_tok_s, "requests_s": self.requests_s}


def percentiles(values: list[float], scale: float = 1000.0) -> dict | None:
    if not values:
        return None
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] * scale

    return {"mean": statistics.fmean(ordered) * scale, "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def summarize(name: str, wall_s: float, timings: list[RequestTiming], input_tokens: int, extra=None) -> RunResult:
    return RunResult(
        name=name, wall_s=wall_s, num_requests=len(timings), output_tokens=sum(t.output_tokens for t in timings),
        input_tokens=input_tokens, ttft_ms=percentiles([t.ttft_s for t in timings]),
        tpot_ms=percentiles([t.tpot_s for t in timings if t.tpot_s is not None]),
        itl_ms=percentiles([gap for t in timings for gap in t.itl_s]),
        e2e_ms=percentiles([t.e2e_s for t in timings]), extra=extra, ttft_stages_ms=_stages(timings),
        ttft_stages_requests=sum(1 for t in timings if t.ttft_stages_s))


def _stages(timings: list[RequestTiming]) -> dict | None:
    staged = [t.ttft_stages_s for t in timings if t.ttft_stages_s]
    return {stage: percentiles([s[stage] for s in staged]) for stage in staged[0]} if staged else None


def stages_table(results: list[RunResult]) -> str:
    """TTFT by stage, p50 / p90 ms, for the runs that measured stages (empty where none did)."""
    staged = [r for r in results if r.ttft_stages_ms]
    if not staged:
        return ""
    stages = list(staged[0].ttft_stages_ms)
    rows = [["TTFT by stage, p50 / p90 ms (requests with stages)"] + stages]
    rows += [[f"{r.name} ({r.ttft_stages_requests}/{r.num_requests})"]
             + [f"{r.ttft_stages_ms[s]['p50']:.1f} / {r.ttft_stages_ms[s]['p90']:.1f}" for s in stages] for r in staged]
    return _columns(rows)


def table(results: list[RunResult], baseline: str | None = None) -> str:
    """A fixed-width table; ratios are against the named baseline row."""
    base = next((r for r in results if r.name == baseline), None)
    header = ["run", "requests", "out tok", "wall s", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms",
              "TPOT p50 ms", "E2E p50 ms"] + ([f"x {baseline}"] if base else [])
    rows = [header]
    for r in results:
        def fmt(d, key):
            return f"{d[key]:.1f}" if d else "-"
        row = [r.name, str(r.num_requests), str(r.output_tokens), f"{r.wall_s:.2f}", f"{r.output_tok_s:.1f}",
               f"{r.requests_s:.2f}", fmt(r.ttft_ms, "p50"), fmt(r.ttft_ms, "p99"), fmt(r.tpot_ms, "p50"),
               fmt(r.e2e_ms, "p50")]
        if base:
            row.append(f"{r.output_tok_s / base.output_tok_s:.2f}")
        rows.append(row)
    return _columns(rows)


def _columns(rows: list[list[str]]) -> str:
    """Rows of cells as fixed-width text: the first column left-aligned, a rule under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
