"""How requests reached the engine and how its steps took them, from a serve run's stamps.

`tools/benchmark.py serve --request-stamps` keeps each request's wall-clock stamps (the client's
send, the Engine replica's arrival, the step that first scheduled it, its first and last tokens).
Requests scheduled by one step share that step's stamp, so the distinct stamps are the steps that
took new requests. For each request this counts the steps that took others while it waited (it was
left behind: the step's token budget, or arrival order) and splits its wait into the part before the
next step began and the rest:

    python -m tools.bench.arrivals gpu-results/serve/dag-triton-high.json [--bin-ms 10] [--steps]
"""
from __future__ import annotations

import argparse
import bisect
import json
from collections import Counter

from tools.bench.report import percentiles


def analyse(stamps: list[dict], bin_ms: float = 10.0) -> dict:
    rows = [s for s in stamps if s and s["arrival"] and s["first_scheduled"]]
    steps = sorted({s["first_scheduled"] for s in rows})
    taken = Counter(s["first_scheduled"] for s in rows)
    passed, to_next_step, behind = [], [], []
    for s in rows:
        first = bisect.bisect_left(steps, s["arrival"])  # the first step that began after it arrived
        mine = bisect.bisect_left(steps, s["first_scheduled"])
        passed.append(mine - first)
        next_step = steps[first] if first < len(steps) else s["first_scheduled"]
        to_next_step.append(next_step - s["arrival"])
        behind.append(s["first_scheduled"] - next_step)
    start = min(s["arrival"] for s in rows)
    bins = Counter(int((s["arrival"] - start) * 1000 / bin_ms) for s in rows)
    per_bin = [bins.get(i, 0) for i in range(max(bins) + 1)]
    return {
        "requests": len(rows),
        "steps that took new requests": len(steps),
        "new requests a step took": percentiles(list(taken.values()), 1.0),
        "queued ms": percentiles([s["first_scheduled"] - s["arrival"] for s in rows]),
        "  until the next step began": percentiles(to_next_step),
        "  left behind after that": percentiles(behind),
        "steps that passed a request by": dict(sorted(Counter(passed).items())),
        "way in ms (sent -> Engine)": percentiles([s["arrival"] - s["sent"] for s in rows]),
        "way out ms (last token -> client done)": percentiles([s["done"] - s["last_token"] for s in rows]),
        f"arrivals a {bin_ms:g} ms bin": {"busiest": max(per_bin),
                                          "busiest 1%": sorted(per_bin)[int(0.99 * (len(per_bin) - 1))],
                                          "mean": len(rows) / len(per_bin)},
    }


def step_timeline(stamps: list[dict]) -> list[dict]:
    """Per step that took new requests: when (ms from the first arrival), how many it took, how many
    it left waiting, and how many arrived since the step before it."""
    rows = [s for s in stamps if s and s["arrival"] and s["first_scheduled"]]
    start = min(s["arrival"] for s in rows)
    timeline, previous = [], None
    for step in sorted({s["first_scheduled"] for s in rows}):
        timeline.append({
            "at ms": round((step - start) * 1000, 1),
            "took": sum(1 for s in rows if s["first_scheduled"] == step),
            "left waiting": sum(1 for s in rows if s["arrival"] <= step < s["first_scheduled"]),
            "arrived since the last": sum(1 for s in rows if previous is not None and previous < s["arrival"] <= step),
        })
        previous = step
    return timeline


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+")
    parser.add_argument("--bin-ms", type=float, default=10.0)
    parser.add_argument("--steps", action="store_true", help="also list every step that took new requests")
    args = parser.parse_args(argv)
    for path in args.json:
        for result in json.load(open(path))["results"]:
            if result.get("request_stamps_s"):
                print(f"== {path}: {result['name']}")
                print(json.dumps(analyse(result["request_stamps_s"], args.bin_ms), indent=1))
                for step in step_timeline(result["request_stamps_s"]) if args.steps else ():
                    print("  ".join(f"{key} {value}" for key, value in step.items()))


if __name__ == "__main__":
    main()
