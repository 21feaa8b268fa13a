"""Throughput against concurrency and latency against request rate, for our engine and, in the
same process on the same card, transformers' static batches and continuous batching. Writes JSON
after every run (a run cut short keeps what it measured); tools/bench/plot_sweep.py draws it.

  python -m tools.bench.sweep --model configs/shapes/llama-3.1-8b --load-format dummy --device cuda \\
      --json sweep.json
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from app.engine import EngineConfig, LLMEngine, SamplingParams
from app.engine.worker import resolve_dtype
from app.heap import startup_heap_frozen
from tools.bench.engine_runner import run_engine
from tools.bench.workload import run_seed, synthetic


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="configs/shapes/llama-3.1-8b")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", default="128")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--rates", type=float, nargs="+", default=[8, 32, 128], help="requests/s, Poisson arrivals")
    p.add_argument("--rate-requests", type=int, default=128)
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--kv-tokens", type=int, default=131072)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--only-generate-batch", type=Path, default=None,
                   help="add transformers' generate_batch to an earlier sweep JSON, nothing else")
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    top = max(args.concurrency)
    report = {"args": vars(args), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "concurrency": [], "rates": [], "hf_static": [], "hf_generate_batch": None}

    def save(section: str, result, **keys) -> None:
        row = {**keys, **result.as_dict()}
        report[section] = row if section == "hf_generate_batch" else report[section] + [row]
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"{result.name}: {result.output_tok_s:,.0f} out tok/s", flush=True)

    if args.only_generate_batch:
        report = json.loads(args.only_generate_batch.read_text())
        return _generate_batch(args, report, save)
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                    load_format=args.load_format, max_batch_size=top,
                                    max_num_tokens=args.max_num_tokens,
                                    kv_cache_config={"max_tokens": args.kv_tokens}))
    vocab = engine.limits.vocab_size
    engine.generate([[100] * 16], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    with startup_heap_frozen():  # as the engine's serving process runs (app/heap.py); thawed to free it after
        for c in args.concurrency:
            wl = synthetic(max(2 * c, 4), args.input_len, args.output_len, vocab, run_seed(0, c), concurrency=c)
            save("concurrency", run_engine(engine, wl, f"ours c={c}"), concurrency=c)
        for rate in args.rates:
            wl = synthetic(args.rate_requests, args.input_len, args.output_len, vocab, run_seed(0, "rate", rate),
                           concurrency=top, request_rate=rate)
            save("rates", run_engine(engine, wl, f"ours {rate:g} req/s"), rate=rate)
    engine.shutdown()
    del engine
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    if args.no_hf:
        return
    from tools.bench.hf_baseline import run_static_batches
    model = _load_hf(args)
    for c in args.concurrency:  # one static batch of c requests
        wl = synthetic(c, args.input_len, args.output_len, vocab, concurrency=c)
        save("hf_static", run_static_batches(model, wl), concurrency=c)
    _generate_batch(args, report, save, model)


def _load_hf(args):
    from tools.bench.hf_baseline import load_hf
    return load_hf(args.model, resolve_dtype(args.dtype, torch.device(args.device)), args.device,
                   dummy=args.load_format == "dummy")


def _generate_batch(args, report: dict, save, model=None) -> None:
    from tools.bench.hf_baseline import run_generate_batch
    model = _load_hf(args) if model is None else model
    top = max(args.concurrency)
    try:
        wl = synthetic(top, args.input_len, args.output_len, model.config.vocab_size, concurrency=top)
        save("hf_generate_batch", run_generate_batch(model, wl), concurrency=top)
    except Exception as exc:  # noqa: BLE001 - an API that moves between versions; the rest stands
        report["hf_generate_batch"] = {"error": repr(exc)}
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"generate_batch failed: {exc!r}", flush=True)


if __name__ == "__main__":
    main()
