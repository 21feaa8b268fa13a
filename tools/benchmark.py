"""Benchmarks. `engine`: our engine in-process (no Ray) on a fixed workload, optionally beside
transformers' own generation on the same prompts in the same run.

    python tools/benchmark.py engine --num-requests 16 --concurrency 16 --input-len 64:128 \
        --output-len 64 --ignore-eos --compare hf --json results/engine.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from app.engine import EngineConfig, LLMEngine, SamplingParams
from app.engine.model_runner import resolve_dtype
from tools.bench.engine_runner import run_engine
from tools.bench.report import table
from tools.bench.workload import synthetic


def engine_command(args) -> dict:
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, max_batch_size=args.max_batch_size,
                          max_num_tokens=args.max_num_tokens, scheduler_policy=args.policy,
                          batching_type=args.batching, enable_chunked_prefill=not args.no_chunked_prefill,
                          kv_cache_config={"max_tokens": args.kv_tokens, "tokens_per_block": args.block_size,
                                           "enable_block_reuse": not args.no_reuse})
    engine = LLMEngine(config)
    wl = synthetic(args.num_requests, args.input_len, args.output_len, engine.limits.vocab_size, args.seed,
                   args.ignore_eos, args.concurrency, args.request_rate, args.arrival)
    engine.generate([wl.prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    results = [run_engine(engine, wl)]
    if "hf" in args.compare:
        from tools.bench.hf_baseline import load_hf, run_sequential, run_static_batches
        model = load_hf(engine.model_dir, resolve_dtype(args.dtype, torch.device(args.device)), args.device)
        results.append(run_sequential(model, wl, min(args.hf_sequential_requests, wl.num_requests)))
        results.append(run_static_batches(model, wl))
    print(table(results, baseline=results[-1].name if len(results) > 1 else None))
    return {
        "command": "engine", "args": vars(args), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"},
        "model_dir": str(engine.model_dir), "dtype": str(engine.runner.dtype),
        "results": [r.as_dict() for r in results],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("engine", help="our engine in-process, optionally against transformers")
    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--device", default="cpu")
    e.add_argument("--dtype", default="auto")
    e.add_argument("--num-requests", type=int, default=16)
    e.add_argument("--concurrency", type=int, default=16, help="most requests in flight at once")
    e.add_argument("--request-rate", type=float, default=None, help="requests/s (default: all at once)")
    e.add_argument("--arrival", choices=["exponential", "constant"], default="exponential")
    e.add_argument("--input-len", default="64:128", help="prompt tokens, N or LO:HI (uniform)")
    e.add_argument("--output-len", type=int, default=64)
    e.add_argument("--ignore-eos", action="store_true")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--max-batch-size", type=int, default=EngineConfig.max_batch_size)
    e.add_argument("--max-num-tokens", type=int, default=EngineConfig.max_num_tokens)
    e.add_argument("--kv-tokens", type=int, default=65536)
    e.add_argument("--block-size", type=int, default=32)
    e.add_argument("--no-reuse", action="store_true")
    e.add_argument("--no-chunked-prefill", action="store_true")
    e.add_argument("--policy", default="GUARANTEED_NO_EVICT", choices=["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"])
    e.add_argument("--batching", default="INFLIGHT", choices=["INFLIGHT", "STATIC"])
    e.add_argument("--compare", nargs="*", default=[], choices=["hf"])
    e.add_argument("--hf-sequential-requests", type=int, default=4,
                   help="how many requests the sequential baseline runs (its tokens/s is per request)")
    e.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report = engine_command(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
