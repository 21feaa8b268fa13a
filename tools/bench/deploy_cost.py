"""What deploying the app costs: the seconds `serve.run` takes until every replica is ready, and
each stage's resident memory once it is (summed over the stage's replicas), on a local Ray
instance of this machine.

    python -m tools.bench.deploy_cost --config configs/smollm2-135m.yaml [--runs 3]

Each run starts Ray, deploys, measures and shuts Ray down, so runs do not share warm processes.
To compare two trees, run this file from each tree's root with that tree on the path
(`PYTHONPATH=. python /path/to/tools/bench/deploy_cost.py`), alternating; the 2-core box is noisy.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def one_run(config: str) -> dict:
    import psutil
    import ray
    from ray import serve

    from app.engine.executor import free_port
    from deployments.app import build_app

    port = free_port("127.0.0.1")
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        start = time.monotonic()
        serve.run(build_app({"config": config}), name="llm", route_prefix="/")
        seconds = time.monotonic() - start
        rss_mb: dict[str, int] = {}
        for proc in psutil.process_iter(["cmdline", "memory_info"]):
            title = (proc.info["cmdline"] or [""])[0]  # Ray titles a replica "ray::ServeReplica:llm:Ingress..."
            if title.startswith("ray::ServeReplica:llm:") and proc.info["memory_info"] is not None:
                stage = title.removeprefix("ray::ServeReplica:llm:").split(".")[0].split()[0]
                rss_mb[stage] = rss_mb.get(stage, 0) + (proc.info["memory_info"].rss >> 20)
        serve.shutdown()
    finally:
        ray.shutdown()
    return {"serve_run_s": seconds, "rss_mb": dict(sorted(rss_mb.items()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/smollm2-135m.yaml")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="write every run here")
    args = parser.parse_args()
    runs = []
    for n in range(args.runs):
        runs.append(one_run(args.config))
        print(f"run {n + 1}: serve.run {runs[-1]['serve_run_s']:.1f} s; RSS MB by stage {runs[-1]['rss_mb']}", flush=True)
    print(f"serve.run median {statistics.median(r['serve_run_s'] for r in runs):.1f} s over {len(runs)} runs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
