"""How the engine's TTFT moves when a wave of requests arrives spread over S ms instead of at once
(through the Serve DAG a wave of 256 reaches the engine over 100-170 ms). One fresh prompt set per
run; the engine alone, in-process, its heap frozen as it serves. Per run: TTFT p50 / p90 from each
request's own arrival time, and every step's start, wall time, prompt tokens and decode rows and
the requests arrived by then, until the last prompt has its first token.

    python -m tools.bench.spread --spreads 0 150 --repeats 3 [--disable-overlap-scheduler]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from app.engine import LLMEngine
from app.heap import freeze_startup_heap
from tools.bench.engine_runner import add_wave_arguments, run_engine, wave_engine_config
from tools.bench.workload import Workload, run_seed, synthetic


def run_wave(engine: LLMEngine, wl: Workload) -> dict:
    """One wave (wl.arrivals_s: when each request arrives): TTFT from arrival (run_engine counts a
    request due during a step from when it was due), and the step log until every prompt has its
    first token."""
    steps, first = [], set()

    def log(started: float, took: float, added: int, outputs: list) -> None:
        if len(first) < wl.num_requests:
            steps.append((round(started * 1e3, 1), round(took * 1e3, 1), engine._last_context_tokens,
                          engine._last_generation_requests, added))
        first.update(out.request_id for out in outputs)

    result = run_engine(engine, wl, "wave", on_step=log)
    return {"ttft_p50_ms": round(result.ttft_ms["p50"], 1), "ttft_p90_ms": round(result.ttft_ms["p90"], 1),
            "ttft_mean_ms": round(result.ttft_ms["mean"], 1), "wall_s": round(result.wall_s, 2),
            "steps_start_ms_wall_ms_prompt_tokens_decodes_arrived": steps}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_wave_arguments(p)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--spreads", type=float, nargs="+", default=[0.0, 150.0], help="ms over which a wave arrives")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--disable-overlap-scheduler", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    config = wave_engine_config(args, args.requests, disable_overlap_scheduler=args.disable_overlap_scheduler)
    engine = LLMEngine(config)
    vocab = engine.limits.vocab_size
    warm = synthetic(args.requests, args.input_len, 4, vocab, run_seed(0, "spread-warm"), True, args.requests)
    run_wave(engine, warm)
    freeze_startup_heap()  # as the engine's serving processes do (app/heap.py)
    rows = []
    for repeat in range(args.repeats):
        for spread in args.spreads:
            wl = synthetic(args.requests, args.input_len, args.output_len, vocab,
                           run_seed(0, "spread", spread, repeat), True, args.requests)
            arrivals = [spread / 1e3 * k / max(1, args.requests - 1) for k in range(args.requests)]
            row = {"spread_ms": spread, "repeat": repeat} | run_wave(engine, replace(wl, arrivals_s=arrivals))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.startswith("steps")}), flush=True)
    engine.shutdown()
    if args.json:
        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        args.json.write_text(json.dumps({"device": device, "args": vars(args) | {"json": str(args.json)},
                                         "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
