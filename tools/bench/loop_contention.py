"""Why the engine slows inside a Serve replica: two suspects measured on the bare engine, no Ray.

1. Arrivals. The engine benchmark admits requests in waves (all 128/128 requests of a wave finish
   together), so nearly every step is a decode-only CUDA-graph replay. Behind the DAG, requests
   arrive and finish out of step, so many steps carry a prefill chunk and run eagerly.
2. The GIL. In a replica the engine loop shares its interpreter with Ray's serialization thread and
   the asyncio thread; here K busy Python threads pickle and unpickle messages beside the loop.
Each run reports output tok/s, TPOT p50 and the share of steps that carried a prefill.

    python -m tools.bench.loop_contention --model configs/shapes/llama-3.1-8b --device cuda
"""
from __future__ import annotations

import argparse
import json
import pickle
import sys
import threading

from app.engine import EngineConfig, LLMEngine, SamplingParams
from tools.bench.engine_runner import run_engine
from tools.bench.workload import run_seed, synthetic

DEFAULT_SWITCH_S = sys.getswitchinterval()


def busy_threads(count: int) -> threading.Event:
    """K threads that pickle and unpickle a step's worth of small outputs, as Ray's do."""
    stop = threading.Event()
    message = [{"request_id": f"r{i}", "token_ids": [i], "logprobs": None, "finished": False} for i in range(256)]

    def spin():
        while not stop.is_set():
            pickle.loads(pickle.dumps(message))

    for _ in range(count):
        threading.Thread(target=spin, daemon=True).start()
    return stop


def count_prefill_steps(engine: LLMEngine) -> dict:
    counts = {"steps": 0, "prefill": 0}
    schedule = engine.scheduler.schedule

    def counted():
        plan = schedule()
        if not plan.is_empty:
            counts["steps"] += 1
            counts["prefill"] += any(item.num_tokens > 1 for item in plan.scheduled)
        return plan

    engine.scheduler.schedule = counted
    return counts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="configs/shapes/llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-requests", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--rate", type=float, default=200.0, help="requests/s of the staggered runs")
    p.add_argument("--threads", type=int, nargs="+", default=[0, 2])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype="bfloat16", load_format="dummy",
                                    max_batch_size=512, max_num_tokens=8192,
                                    kv_cache_config={"max_tokens": 262144}))
    vocab = engine.limits.vocab_size
    engine.generate([[100] * 16], SamplingParams(max_tokens=4, temperature=0.0))
    counts = count_prefill_steps(engine)
    rows = []
    for arrivals in ("waves", "staggered"):
        for threads in args.threads:
            for interval in ([DEFAULT_SWITCH_S] + ([0.0005] if threads else [])):
                rate = args.rate if arrivals == "staggered" else None
                wl = synthetic(args.num_requests, "128", 128, vocab, run_seed(0, arrivals, threads, interval), True,
                               args.concurrency, rate)
                counts.update(steps=0, prefill=0)
                sys.setswitchinterval(interval)
                stop = busy_threads(threads)
                result = run_engine(engine, wl, f"{arrivals}, {threads} busy threads, switch {interval * 1e3:g} ms")
                stop.set()
                row = {"run": result.name, "tok_s": round(result.output_tok_s), "tpot_p50_ms": result.tpot_ms["p50"],
                       "ttft_p50_ms": result.ttft_ms["p50"], "steps": counts["steps"],
                       "prefill_steps": counts["prefill"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    sys.setswitchinterval(DEFAULT_SWITCH_S)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": args.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
