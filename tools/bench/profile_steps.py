"""Where a steady decode step's time goes on the device: our engine on a dummy-weight shape, a
batch of sequences decoding, timed over many steps, then the same steps under torch.profiler
(kernels replayed from CUDA graphs included). Prints the step's wall time, the GPU's busy time
per step and the kernels that fill it.

    python -m tools.bench.profile_steps --model configs/shapes/smollm2-135m --batch 1
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from app.engine import EngineConfig, LLMEngine, SamplingParams
from app.heap import freeze_startup_heap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--disable-overlap-scheduler", action="store_true")
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, device="cuda", dtype="bfloat16", load_format="dummy",
                                    disable_overlap_scheduler=args.disable_overlap_scheduler,
                                    max_batch_size=max(8, args.batch), max_num_tokens=8192, quantization=args.quantization,
                                    kv_cache_config={"max_tokens": args.batch * (args.input_len + 3 * args.steps + 64),
                                                     "dtype": args.kv_cache_dtype}))
    params = SamplingParams(max_tokens=2 * args.steps + 16, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        engine.add_request(f"p{i}", torch.randint(2, 1000, (args.input_len,), generator=g).tolist(), params)
    decoding: set[str] = set()
    while len(decoding) < args.batch:  # the prompts' prefill steps, which are not what is measured here
        decoding.update(out.request_id for out in engine.step())
    for _ in range(10):  # decode steps until every graph and kernel is warm
        engine.step()
    freeze_startup_heap()  # as the engine's serving process runs (app/heap.py)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    busy_ms = sum(e.self_device_time_total for e in events) / args.steps / 1e3
    kernels = sum(e.count for e in events if e.self_device_time_total > 0 and e.device_type.name == "CUDA")
    print(f"{args.model} batch {args.batch} (linears {args.quantization or 'bf16'}, cache {args.kv_cache_dtype}): "
          f"step {wall_ms:.3f} ms wall, GPU busy {busy_ms:.3f} ms, {kernels / args.steps:.0f} kernels per step",
          flush=True)
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows), flush=True)


if __name__ == "__main__":
    main()
