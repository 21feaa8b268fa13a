"""Ray cluster autoscaling as a timeline: runs the scenario of tests/serve/test_cluster_autoscaling.py
(worker nodes that Ray's autoscaler adds and removes as Serve scales the engine under load), or reads
the JSON it wrote, prints the steps and what changed when, and draws it (--png needs matplotlib, which
requirements.txt leaves out: any Python that has it can draw a JSON the scenario wrote).

    .venv/bin/python tools/cluster_timeline.py --out docs/results/cluster-autoscaling.json
    python tools/cluster_timeline.py --from docs/results/cluster-autoscaling.json --png docs/cluster-autoscaling.png
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere


def rows(seen: dict) -> list[tuple[float, int, int, int, str]]:
    """The samples where something changed: (seconds from the load's start, streams in flight,
    running engine replicas, worker nodes, requests on each engine replica by node)."""
    out, last = [], None
    for s in seen["samples"]:
        engines = " ".join(f"{_node(seen, node)}:{n}" for node, n in sorted(s["engines"].items()))
        row = (s["in_flight"], s["replicas"], s["workers"], engines)
        if row != last:
            out.append((s["t"] - seen["load_start_s"], *row))
        last = row
    return out


def _node(seen: dict, node: str) -> str:
    return {seen["first_node"]: "first", seen["new_node"]: "added"}.get(node, node[-5:])


def report(seen: dict) -> str:
    up, down, streams = seen["scale_up"], seen["scale_down"], seen["streams"]
    failed = sum(1 for s in streams
                 if s["status"] != 200 or s["error"] or not s["done"] or s["finish_reason"] != "length")
    lines = [f"{'t (s)':>7} {'in flight':>9} {'replicas':>8} {'workers':>7}  requests per engine node"]
    lines += [f"{t:7.1f} {load:9d} {replicas:8d} {workers:7d}  {engines}"
              for t, load, replicas, workers, engines in rows(seen)]
    lines.append(f"load on at 0 s: worker node up {up['node_s']:.1f} s, second replica running "
                 f"{up['replica_s']:.1f} s, serving on the added node {up['serving_s']:.1f} s")
    lines.append(f"load off at {seen['load_end_s'] - seen['load_start_s']:.1f} s: replica stopped after "
                 f"{down['replica_s']:.1f} s, idle node removed after {down['node_s']:.1f} s")
    lines.append(f"{len(streams)} streams, {failed} failed or cut")
    return "\n".join(lines)


def plot(seen: dict, target: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = seen["load_start_s"]
    t = [s["t"] - start for s in seen["samples"]]
    fig, ax = plt.subplots(figsize=(9, 4.4))
    for key, label, style in (("in_flight", "streams in flight", "-"), ("replicas", "engine replicas (running)", "-"),
                              ("workers", "worker nodes (alive)", "--")):
        ax.step(t, [s[key] for s in seen["samples"]], style, where="post", label=label, linewidth=2)
    ax.axvspan(0, seen["load_end_s"] - start, color="tab:gray", alpha=0.12, label="load on")
    up, down = seen["scale_up"], seen["scale_down"]
    ax.axvline(up["serving_s"], color="tab:green", linestyle=":", label=f"added node serving ({up['serving_s']:.1f} s)")
    removed = seen["load_end_s"] - start + down["node_s"]
    ax.axvline(removed, color="tab:red", linestyle=":", label=f"idle node removed ({down['node_s']:.1f} s after load)")
    ax.set(xlabel="seconds from the load's start", ylabel="count", yticks=range(4),
           title="Serve adds an engine replica, Ray's autoscaler a node for it; both go when the load does")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize=8)  # below: the lines fill the top
    fig.tight_layout()
    fig.savefig(target, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", help="a JSON the scenario wrote (default: run the scenario)")
    parser.add_argument("--out", help="keep the scenario's JSON here")
    parser.add_argument("--png", help="draw the timeline here (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.source:
        seen = json.loads(Path(args.source).read_text())
    else:
        from tests.serve.test_cluster_autoscaling import run_scenario

        with tempfile.TemporaryDirectory() as work:
            out = Path(work) / "seen.json"
            seen = run_scenario(out)
            if args.out:
                shutil.copy(out, args.out)
    print(report(seen))
    if args.png:
        plot(seen, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
