"""What a frozen start-up heap (app/heap.py) is worth to the engine: one engine runs the same workload
with its heap as built and frozen, alternated, each run on fresh prompts. Per run: tok/s, TPOT,
TTFT, and every full collection (the oldest generation) that ran during it, in ms.

    python -m tools.bench.heap_ab --num-requests 1024 --concurrency 256 [--quantization fp8]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from pathlib import Path

import torch

from app.engine import LLMEngine, SamplingParams
from app.heap import startup_heap_frozen
from tools.bench.engine_runner import add_wave_arguments, run_engine, wave_engine_config
from tools.bench.workload import run_seed, synthetic


class FullCollections:
    """The duration of each collection of the oldest generation, from gc.callbacks."""

    def __init__(self):
        self.ms: list[float] = []
        self._started = 0.0
        gc.callbacks.append(self._observe)

    def _observe(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.ms.append(round((time.perf_counter() - self._started) * 1e3, 1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_wave_arguments(p)
    p.add_argument("--num-requests", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quantization", choices=["fp8"], default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    engine = LLMEngine(wave_engine_config(args, args.concurrency, quantization=args.quantization))
    engine.generate([[100] * 16], SamplingParams(max_tokens=4, temperature=0.0))  # as the benchmarks warm up
    collections = FullCollections()
    rows = []
    for round_ in range(args.rounds):
        for frozen in (False, True):
            wl = synthetic(args.num_requests, args.input_len, args.output_len, engine.limits.vocab_size,
                           run_seed(0, "heap", round_, frozen), True, args.concurrency)
            with startup_heap_frozen() if frozen else contextlib.nullcontext():
                collections.ms.clear()  # not the freeze's own collection
                result = run_engine(engine, wl, "frozen" if frozen else "as built")
            rows.append({"heap": result.name, "round": round_, "output_tok_s": round(result.output_tok_s),
                         "tpot_ms": result.tpot_ms, "ttft_ms": result.ttft_ms,
                         "full_collections_ms": list(collections.ms)})
            print(json.dumps({k: rows[-1][k] for k in ("heap", "round", "output_tok_s", "full_collections_ms")}),
                  flush=True)
    engine.shutdown()
    if args.json:
        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        args.json.write_text(json.dumps({"device": device, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                         "args": vars(args) | {"json": str(args.json)}, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
