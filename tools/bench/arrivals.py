"""How requests reached the engine and how its steps took them, from a serve run's stamps.

`tools/benchmark.py serve --request-stamps` keeps each request's wall-clock stamps (the client's
send, the Engine replica's arrival, the step that first scheduled it, its first and last tokens).
Requests scheduled by one step share that step's stamp, so the distinct stamps are the steps that
took new requests; a step that took none leaves no stamp and is not seen here.

For each request this counts the seen steps that took others while it waited (a lower bound on the
steps that passed it by). Causes: the step's token budget, arrival order, or the hop from the
Engine replica (where arrival is stamped) to the engine's process, which a request may still have
been on when the step was planned. Its wait splits into the part until the next seen step began and
the rest:

    python -m tools.bench.arrivals gpu-results/serve/dag-triton-high.json [--bin-ms 10] [--steps]
"""
from __future__ import annotations

import argparse
import bisect
import json
from collections import Counter

from tools.bench.report import percentiles
from tools.bench.serve_runner import ENGINE_STAMPS


def complete(stamps: list[dict | None]) -> list[dict]:
    """The requests with every engine stamp (0: the engine never set it), in order on one clock."""
    return [s for s in stamps if s and all(s[key] for key in ENGINE_STAMPS)
            and s["arrival"] <= s["first_scheduled"] <= s["first_token"] <= s["last_token"]]


def analyse(stamps: list[dict | None], bin_ms: float = 10.0) -> dict:
    rows = complete(stamps)
    if not rows:
        return {"requests": 0}
    taken = Counter(s["first_scheduled"] for s in rows)  # step -> new requests it took
    steps = sorted(taken)
    passed, to_next_step, behind = [], [], []
    for s in rows:
        first = bisect.bisect_left(steps, s["arrival"])  # the first seen step that began once it had arrived
        mine = bisect.bisect_left(steps, s["first_scheduled"])  # its own: at or after `first`
        passed.append(mine - first)
        to_next_step.append(steps[first] - s["arrival"])
        behind.append(s["first_scheduled"] - steps[first])
    start = min(s["arrival"] for s in rows)
    bins = Counter(int((s["arrival"] - start) * 1000 / bin_ms) for s in rows)
    per_bin = sorted(bins.get(i, 0) for i in range(max(bins) + 1))
    return {
        "requests": len(rows),
        "steps that took new requests": len(steps),
        "new requests a step took": percentiles(list(taken.values()), 1.0),
        "queued ms": percentiles([s["first_scheduled"] - s["arrival"] for s in rows]),
        "  until the next step that took requests": percentiles(to_next_step),
        "  passed by after that": percentiles(behind),
        "steps that took others while it waited": dict(sorted(Counter(passed).items())),
        "way in ms (sent -> Engine)": percentiles([s["arrival"] - s["sent"] for s in rows]),
        "way out ms (last token -> client done)": percentiles([s["done"] - s["last_token"] for s in rows]),
        f"arrivals a {bin_ms:g} ms bin": {"busiest": per_bin[-1], "p99": per_bin[int(0.99 * (len(per_bin) - 1))],
                                          "mean": len(rows) / len(per_bin)},
    }


def step_timeline(stamps: list[dict | None]) -> list[dict]:
    """Per step that took new requests: when (ms from the first arrival), how many it took, how many
    it left waiting, and how many arrived since the step before it."""
    rows = complete(stamps)
    start = min((s["arrival"] for s in rows), default=0.0)
    taken = Counter(s["first_scheduled"] for s in rows)
    timeline, previous = [], None
    for step in sorted(taken):
        timeline.append({
            "at ms": round((step - start) * 1000, 1),
            "took": taken[step],
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
        with open(path) as f:
            results = json.load(f)["results"]
        for result in results:
            if result.get("request_stamps_s"):
                print(f"== {path}: {result['name']}")
                print(json.dumps(analyse(result["request_stamps_s"], args.bin_ms), indent=1))
                for step in step_timeline(result["request_stamps_s"]) if args.steps else ():
                    print("  ".join(f"{key} {value}" for key, value in step.items()))


if __name__ == "__main__":
    main()
