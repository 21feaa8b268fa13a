"""Is the first burst after start slower than the next ones? The same workload, run as several
bursts on one fresh engine, each burst on prompts of its own (a repeated prompt would find its KV
cached). Per burst: tok/s, TTFT, TPOT, the steps slower than --slow-ms (time, prompt tokens,
decode rows), the allocator segments it added, and the Triton kernels it compiled where
TRITON_CACHE_DIR names an empty directory (set it so: Triton's cache outlives the process).

    TRITON_CACHE_DIR=$(mktemp -d) python -m tools.bench.bursts --model configs/shapes/llama-3.1-8b
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from app.engine import LLMEngine, SamplingParams
from app.heap import freeze_startup_heap
from tools.bench.engine_runner import add_wave_arguments, run_engine, wave_engine_config
from tools.bench.workload import run_seed, synthetic


def compiled_kernels() -> set[str]:
    """The kernels in Triton's on-disk cache (one directory per compiled variant)."""
    cache = os.environ.get("TRITON_CACHE_DIR")
    if not cache or not Path(cache).is_dir():
        return set()
    return {f"{entry.name[:8]}:{meta.stem}" for entry in Path(cache).iterdir() for meta in entry.glob("*.json")
            if not meta.name.startswith("__")}


def allocator_segments() -> int:
    """Device memory segments the caching allocator holds (0 off CUDA)."""
    return torch.cuda.memory_stats()["segment.all.allocated"] if torch.cuda.is_initialized() else 0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_wave_arguments(p)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--slow-ms", type=float, default=250.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    config = wave_engine_config(args, args.concurrency)
    started = time.perf_counter()
    engine = LLMEngine(config)
    print(f"engine up in {time.perf_counter() - started:.1f} s, pool {engine.limits.max_cache_tokens} tokens")
    engine.generate([[100] * 16], SamplingParams(max_tokens=4, temperature=0.0))  # as the benchmarks warm up
    freeze_startup_heap()  # as the engine's serving process runs (app/heap.py)
    slow: list[tuple[int, int, int]] = []
    step = engine._step

    def timed_step():
        start = time.perf_counter()
        outputs = step()
        ms = (time.perf_counter() - start) * 1e3
        if ms > args.slow_ms:
            slow.append((round(ms), engine._last_context_tokens, engine._last_generation_requests))
        return outputs
    engine._step = timed_step
    rows = []
    for burst in range(args.bursts):
        slow.clear()
        kernels, segments = compiled_kernels(), allocator_segments()
        workload = synthetic(args.num_requests, args.input_len, args.output_len, engine.limits.vocab_size,
                             run_seed(0, "burst", burst), True, args.concurrency)
        result = run_engine(engine, workload, f"burst {burst}")
        rows.append({"burst": burst, "tok_s": round(result.output_tok_s), "ttft_ms": result.ttft_ms,
                     "tpot_ms": result.tpot_ms,
                     "slow_steps_ms_prompt_tokens_decodes": list(slow),
                     "segments_added": allocator_segments() - segments,
                     "kernels_compiled": sorted(compiled_kernels() - kernels)})
        print(json.dumps(rows[-1]), flush=True)
    engine.shutdown()
    if args.json:
        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        args.json.write_text(json.dumps({"device": device, "args": vars(args) | {
            "json": str(args.json)}, "bursts": rows}, indent=1))


if __name__ == "__main__":
    main()
