"""Draw mixed-adapter runs: tokens/s with adapters over the base model's, per workload, for the
engine alone and through the Serve app, beside issue 15's targets.

  python -m tools.bench.plot_lora docs/lora-gpu.png docs/results/gpu-h200-lora-*.json ...  (needs matplotlib)

Each JSON is a `tools/benchmark.py engine --adapters N` or `serve ... --adapters N` result (the
GPU suite and tools/gpu/serve_bench.sh write them): every adapter run there follows the base run
of its level on the same engine or server. Only the levels of the targets are drawn: 256 in flight,
and batch 1 (one request at a time, each naming one of the adapters).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

TARGETS = {"8 x rank 16": 0.85, "64 x rank 16": 0.75, "8 x rank 64": 0.70, "batch 1": 0.90}
ORDER = ["8 x rank 8", "8 x rank 16", "32 x rank 16", "64 x rank 16", "8 x rank 64", "batch 1"]


def ratios(path: str) -> list[tuple[str, str, float]]:
    """(workload, "engine" or "Serve", adapters / base) for each adapter run in one JSON."""
    data = json.loads(Path(path).read_text())
    default_level = data["args"].get("concurrency")
    rank = (data.get("config") or {}).get("max_lora_rank") or data["args"].get("lora_rank")
    base: dict[tuple[str, int], float] = {}
    out = []
    for result in data["results"]:
        name = result["name"]
        where = "Serve" if name.startswith("dag") else "engine"
        level = re.search(r"c=(\d+)", name)
        level = int(level.group(1)) if level else default_level
        adapters = re.search(r"(\d+) adapters(?: \(rank (\d+)\))?", name)
        if adapters is None:
            base[(where, level)] = result["output_tok_s"]
            continue
        if level not in (1, 256) or (where, level) not in base:
            continue
        count, named_rank = int(adapters.group(1)), adapters.group(2)
        workload = "batch 1" if level == 1 else f"{count} x rank {named_rank or rank}"
        out.append((workload, where, result["output_tok_s"] / base[(where, level)]))
    return out


def main(target: str, *sources: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [point for source in sources for point in ratios(source)]
    # Older JSONs name the device type ("cuda") where newer ones name the card.
    devices = sorted({json.loads(Path(source).read_text())["machine"]["device"] for source in sources} - {"cuda"})
    order = [w for w in ORDER if any(p[0] == w for p in points)]
    fig, axis = plt.subplots(figsize=(9, 4.5))
    for where, marker, shift in (("engine", "o", -0.12), ("Serve", "^", 0.12)):
        mine = [(order.index(w) + shift, r) for w, kind, r in points if kind == where and w in order]
        axis.plot([x for x, _ in mine], [r for _, r in mine], marker, linestyle="none", alpha=0.75,
                  markersize=8, label="engine alone" if where == "engine" else "through the Serve app (/v1)")
    for i, workload in enumerate(order):
        if workload in TARGETS:
            axis.hlines(TARGETS[workload], i - 0.35, i + 0.35, colors="red", linestyles="--",
                        label="target" if i == order.index(next(w for w in order if w in TARGETS)) else None)
    axis.set_xticks(range(len(order)), order)
    axis.set(ylim=(0.5, 1.05), ylabel="output tok/s, adapters / base model",
             title=f"Mixed LoRA adapters against the base model, {', '.join(devices)}\n"
                   "(each point: one run of both on one engine or server)")
    axis.grid(True, axis="y", alpha=0.3)
    axis.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(target, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
