"""Soak test: hold N concurrent streams for M minutes with mixed lengths, LoRA adapters and
cancellations; report errors (goal: zero), latency drift and the memory of every Serve process
(goal: flat).

    .venv/bin/python tools/soak.py --streams 64 --minutes 10 --out docs/results/soak-cpu.json

Without --url it starts the default app itself (with generated adapters under a temporary root)
in this process, so that it can read the replicas' memory through Ray.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

TEXTS = ["Hi.", "What is machine learning?", "Write a poem about the sea and the wind over the harbour.",
         "Explain, step by step, how a compiler turns source code into machine code. " * 4,
         "用中文介绍一下北京。", "List ten fruits 🍎 with one fact each."]
MAX_TOKENS = [8, 32, 96, 200]


@dataclass
class Window:
    start_s: float
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    completed: int = 0
    cancelled: int = 0
    errors: list[str] = field(default_factory=list)
    rss_mb: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict:
        p99 = lambda xs: statistics.quantiles(xs, n=100)[98] if len(xs) >= 2 else (xs[0] if xs else None)  # noqa: E731
        return {"start_s": round(self.start_s, 1), "completed": self.completed, "cancelled": self.cancelled,
                "errors": len(self.errors), "ttft_p50_s": statistics.median(self.ttft_s) if self.ttft_s else None,
                "ttft_p99_s": p99(self.ttft_s), "tpot_p50_s": statistics.median(self.tpot_s) if self.tpot_s else None,
                "tpot_p99_s": p99(self.tpot_s), "rss_mb": self.rss_mb}


class Soak:
    def __init__(self, url: str, streams: int, duration_s: float, window_s: float, adapters: list[str],
                 cancel_fraction: float, seed: int, headers: dict | None = None):
        self.url, self.streams, self.duration_s, self.window_s = url, streams, duration_s, window_s
        self.adapters, self.cancel_fraction = adapters, cancel_fraction
        self.rng = random.Random(seed)
        self.headers = headers or {}
        self.windows: list[Window] = []
        self.t0 = 0.0

    @property
    def window(self) -> Window:
        return self.windows[-1]

    async def run(self) -> dict:
        self.t0 = time.monotonic()
        self.windows.append(Window(0.0))
        limits = httpx.Limits(max_connections=self.streams + 4, max_keepalive_connections=self.streams + 4)
        async with httpx.AsyncClient(base_url=self.url, timeout=300, limits=limits, headers=self.headers) as client:
            ticker = asyncio.create_task(self._tick())
            await asyncio.gather(*(self._worker(client) for _ in range(self.streams)))
            ticker.cancel()
        self.window.rss_mb = process_rss_mb()
        return self.report()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.window_s)
            self.window.rss_mb = process_rss_mb()
            self.windows.append(Window(time.monotonic() - self.t0))

    async def _worker(self, client: httpx.AsyncClient) -> None:
        while time.monotonic() - self.t0 < self.duration_s:
            body = {"text_input": self.rng.choice(TEXTS), "max_tokens": self.rng.choice(MAX_TOKENS),
                    "temperature": self.rng.choice([0.0, 0.8]), "seed": self.rng.randrange(1 << 16)}
            adapter = self.rng.choice([None, *self.adapters])
            if adapter is not None:
                body["lora_task_id"] = adapter
            cancel_after = self.rng.uniform(0.05, 1.0) if self.rng.random() < self.cancel_fraction else None
            try:
                await asyncio.wait_for(self._one(client, body), timeout=cancel_after)
            except asyncio.TimeoutError:
                self.window.cancelled += 1  # the client left mid-stream, on purpose
            except Exception as exc:  # noqa: BLE001 - every failure is counted and named
                self.window.errors.append(f"{type(exc).__name__}: {exc}"[:300])

    async def _one(self, client: httpx.AsyncClient, body: dict) -> None:
        start = time.monotonic()
        stamps = []
        async with client.stream("POST", "/v2/models/ensemble/generate_stream", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            last = None
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    last = json.loads(line[6:])
                    if "error" in last:
                        raise RuntimeError(f"stream error: {last['error']}")
                    stamps.append(time.monotonic())
            if last is None or not last.get("finish_reason"):
                raise RuntimeError("stream ended without a finish reason")
        self.window.completed += 1
        self.window.ttft_s.append(stamps[0] - start)
        tokens = body["max_tokens"]  # an upper bound when it stopped early; fine for drift
        if len(stamps) > 1:
            self.window.tpot_s.append((stamps[-1] - stamps[0]) / max(tokens - 1, 1))

    def report(self) -> dict:
        windows = [w.summary() for w in self.windows if w.completed or w.errors]
        steady = windows[1:] if len(windows) > 2 else windows  # the first window warms up
        first, last = steady[0], steady[-1]
        growth = {name: round(last["rss_mb"].get(name, 0) - mb, 1) for name, mb in first["rss_mb"].items()}
        drift = (last["tpot_p99_s"] / first["tpot_p99_s"]) if first["tpot_p99_s"] and last["tpot_p99_s"] else None
        errors = [e for w in self.windows for e in w.errors]
        return {"streams": self.streams, "duration_s": self.duration_s,
                "requests": sum(w.completed for w in self.windows), "cancelled": sum(w.cancelled for w in self.windows),
                "errors": len(errors), "error_samples": errors[:10], "tpot_p99_drift": drift,
                "rss_growth_mb": growth, "windows": windows}


def process_rss_mb() -> dict[str, float]:
    """Resident memory of every Serve process on this machine (replicas, proxy, controller), by
    the title Ray gives it (`ray::ServeReplica:<app>:<deployment>`) and pid."""
    import psutil

    out = {}
    for proc in psutil.process_iter(["pid", "cmdline", "memory_info"]):
        title = (proc.info["cmdline"] or [""])[0]
        serve_process = title.startswith(("ray::ServeReplica", "ray::ServeController", "ray::ProxyActor"))
        if serve_process and proc.info["memory_info"]:
            name = title.removeprefix("ray::").removeprefix("ServeReplica:").split(".")[0]
            out[f"{name}#{proc.info['pid']}"] = round(proc.info["memory_info"].rss / 2**20, 1)
    return out


def start_server(config: str, port: int) -> tuple[str, list[str]]:
    """The default app with two generated adapters (named in the config) under a temporary root."""
    import ray
    import yaml
    from ray import serve

    from app.engine.model_dir import resolve_model_dir
    from deployments.app import build_app
    from tools.bench.adapters import make_adapters

    root = Path(tempfile.mkdtemp(prefix="soak-adapters-"))
    adapters = make_adapters(resolve_model_dir(yaml.safe_load(open(config))["model"]), root, 2)
    data = yaml.safe_load(open(config))
    data["lora_roots"] = [str(root)]
    data["lora_adapters"] = {name: str(path) for name, path in adapters.items()}
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"config": str(path)}), name="llm", route_prefix="/")
    return f"http://127.0.0.1:{port}", list(adapters)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start the app in this process)")
    parser.add_argument("--config", default="configs/smollm2-135m.yaml")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--adapters", nargs="*", default=None, help="adapter names the server knows")
    parser.add_argument("--cancel-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args(argv)
    url, adapters = (args.url, args.adapters or []) if args.url else start_server(args.config, args.port)
    soak = Soak(url, args.streams, args.minutes * 60, args.window_s,
                adapters if args.adapters is None else args.adapters, args.cancel_fraction, args.seed)
    report = asyncio.run(soak.run())
    report["machine"] = {"cpus": __import__("os").cpu_count()}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
