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
import statistics
import time
from pathlib import Path

import torch

from app.engine import LLMEngine, SamplingParams
from app.heap import freeze_startup_heap
from tools.bench.engine_runner import add_wave_arguments, wave_engine_config
from tools.bench.workload import run_seed, synthetic


def run_wave(engine: LLMEngine, prompts: list[list[int]], arrivals_s: list[float], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    steps = []
    start = time.perf_counter()
    i = 0
    while i < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while i < len(prompts) and arrivals_s[i] <= now:
            engine.add_request(f"w{i}", prompts[i], params)
            # When it arrived, not when the loop took it: one that arrives during a step waits for
            # the step to end, as it waits in EngineProcess's pipe, and that wait is the engine's.
            arrived[f"w{i}"] = start + arrivals_s[i]
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals_s[i] - (time.perf_counter() - start)))
            continue
        before = time.perf_counter()
        outputs = engine.step()
        after = time.perf_counter()
        if len(first) < len(prompts):
            steps.append((round((before - start) * 1e3, 1), round((after - before) * 1e3, 1),
                          engine._last_context_tokens, engine._last_generation_requests, i))
        for out in outputs:
            first.setdefault(out.request_id, after)
    ttft = sorted((first[r] - arrived[r]) * 1e3 for r in arrived)
    return {"ttft_p50_ms": round(statistics.median(ttft), 1), "ttft_p90_ms": round(ttft[int(0.9 * len(ttft))], 1),
            "ttft_mean_ms": round(statistics.mean(ttft), 1), "wall_s": round(time.perf_counter() - start, 2),
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
    run_wave(engine, warm.prompts, [0.0] * args.requests, 4)
    freeze_startup_heap()  # as the engine's serving processes do (app/heap.py)
    rows = []
    for repeat in range(args.repeats):
        for spread in args.spreads:
            wl = synthetic(args.requests, args.input_len, args.output_len, vocab,
                           run_seed(0, "spread", spread, repeat), True, args.requests)
            arrivals = [spread / 1e3 * k / max(1, args.requests - 1) for k in range(args.requests)]
            row = {"spread_ms": spread, "repeat": repeat} | run_wave(engine, wl.prompts, arrivals, args.output_len)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.startswith("steps")}), flush=True)
    engine.shutdown()
    if args.json:
        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        args.json.write_text(json.dumps({"device": device, "args": vars(args) | {"json": str(args.json)},
                                         "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
