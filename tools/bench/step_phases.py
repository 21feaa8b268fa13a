"""Where a step's host time goes: the engine's step phases timed by wrapping each function, per run,
in ms per step. Runs the benchmark's JSON-schema guided workload and the free one at the guided
answers' lengths (as `tools/benchmark.py engine --guided`), alternating, on one engine; with
--plain, the plain workload alone (NUM_REQUESTS x 128/128, ignore_eos, CONCURRENCY at once).

A phase's time is the host's time inside the function (`readback`: waiting for the device and
copying the step's tokens back; `fill`: the guided masks' fill, on its own thread where the stream
gate is used, so it overlaps the others; `forward`: queuing the model's kernels, on CUDA, or
computing them, on CPU). `wall` per step minus `readback` is what the host was busy: where it is
close to `wall`, the device waited for the host.

    python -m tools.bench.step_phases --model configs/shapes/llama-3.1-8b --rounds 2
    python -m tools.bench.step_phases --model configs/shapes/llama-3.1-8b --plain --num-requests 1024 \
        --concurrency 512 --max-num-tokens 8192 --quantization fp8 --kv-cache-dtype fp8
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import app.engine.guided as guided
import app.engine.llm_engine as llm_engine
import app.engine.model_runner as model_runner
import app.engine.sampler as sampler
import app.engine.scheduler as scheduler
import app.engine.worker as worker
from app.engine import EngineConfig, LLMEngine, SamplingParams
from app.heap import freeze_startup_heap
from tools.bench.engine_runner import run_engine
from tools.bench.workload import fresh_prompts, synthetic

PHASES = [(llm_engine.LLMEngine, "step", "step"), (llm_engine.LLMEngine, "_admit_compiled", "admit"),
          (llm_engine.LLMEngine, "_outputs", "outputs"),
          (model_runner.ModelRunner, "launch", "launch"), (model_runner.ModelRunner, "sample", "queue sampling"),
          (sampler.Sampler, "_mask", "queue masks"), (sampler, "fill_bitmask", "fill"),
          (sampler.DeviceSample, "result", "readback"), (guided.GrammarMatcher, "accept", "accept"),
          (scheduler.Scheduler, "schedule", "schedule"), (scheduler.Scheduler, "update", "update"),
          (model_runner.ModelRunner, "_prepare", "prepare"), (worker.ModelShard, "execute", "forward")]


def timed(spent: dict[str, float]) -> None:
    """Wrap every phase so that its time adds up in `spent`."""
    for owner, name, label in PHASES:
        def wrapper(*args, _inner=getattr(owner, name), _label=label, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_label] += time.perf_counter() - start
        setattr(owner, name, wrapper)


def main() -> None:
    from tools.benchmark import _guided_run

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-gate", action="store_true",
                        help="no stream gate: the masks are filled on the engine's thread before the sampling is queued")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="the interpreter's GIL switch interval in seconds (default: Python's, 0.005)")
    parser.add_argument("--plain", action="store_true", help="the plain workload alone, no guided runs")
    parser.add_argument("--max-num-tokens", type=int, default=EngineConfig.max_num_tokens)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--late-planning", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    spent: dict[str, float] = defaultdict(float)
    timed(spent)
    if args.no_gate:  # as on a driver without stream memory operations
        sampler.StreamGate.for_device = classmethod(lambda cls, device: None)
    if args.switch_interval:  # how long the fill's thread may wait for the GIL the engine's thread holds
        sys.setswitchinterval(args.switch_interval)
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, load_format="dummy",
                                    max_batch_size=args.concurrency, max_num_tokens=args.max_num_tokens,
                                    quantization=args.quantization, late_planning=args.late_planning,
                                    kv_cache_config={"dtype": args.kv_cache_dtype}))
    wl = synthetic(args.num_requests, "128", 128, engine.limits.vocab_size, 0, True, args.concurrency)
    engine.generate([[100] * 16], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up, on no prompt's tokens
    freeze_startup_heap()  # as the engine's serving process runs (app/heap.py)
    rows = []

    def measured(engine, workload, name):
        spent.clear()
        steps, start = engine.num_steps, time.perf_counter()
        result = run_engine(engine, workload, name)
        wall, count = time.perf_counter() - start, engine.num_steps - steps
        per_step = {label: round(seconds / count * 1e3, 3) for label, seconds in sorted(spent.items())}
        per_step["wall"] = round(wall / count * 1e3, 3)
        row = {"run": name, "out_tok_s": round(result.output_tok_s, 1), "steps": count,
               "tpot_p50_ms": (result.tpot_ms or {}).get("p50"), "ms_per_step": per_step,
               "queued_late": (result.extra or {}).get("queued_late")}
        print(json.dumps(row), flush=True)
        rows.append(row)
        return result

    for rnd in range(args.rounds):  # the guided run, then the free one at its lengths (benchmark.py's pair)
        if args.plain:
            measured(engine, fresh_prompts(wl, engine.limits.vocab_size, rnd), f"plain {rnd}")
        else:
            _guided_run(engine, wl, rnd, run=measured)
    engine.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
