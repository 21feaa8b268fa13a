"""Benchmarks.

`engine`: our engine in-process (no Ray) on a fixed workload, optionally beside transformers' own
generation on the same prompts in the same run.

    python tools/benchmark.py engine --num-requests 16 --concurrency 16 --input-len 64:128 \
        --output-len 64 --ignore-eos --compare hf --json results/engine.json

`serve`: streaming load over HTTP against the service (a URL, or one started here from a config),
optionally beside the bare engine on the same workload, at one or more concurrency levels.

    python tools/benchmark.py serve --start configs/smollm2-135m.yaml --concurrency 1 16 64 \
        --compare-engine --ignore-eos --json results/serve.json

On one GPU the engine and a server cannot share the card's memory: measure the engine alone first
(`serve --engine-only`, a process of its own), then start the server (`serve run`) and load it with
`--url`. `--client-processes 1 2` runs each level from one and from two load-generator processes,
to show whether the client is the bound (tools/gpu/serve_bench.sh does all of this).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from app.engine import EngineConfig, LLMEngine, SamplingParams
from app.engine.engine_process import EngineProcess
from app.engine.guided import Guide
from app.engine.worker import resolve_dtype
from app.heap import freeze_startup_heap, startup_heap_frozen
from tools.bench.engine_runner import run_engine
from tools.bench.process_runner import run_engine_process
from tools.bench.report import stages_table, table
from tools.bench.workload import Workload, fresh_prompts, parse_range, run_seed, synthetic


def engine_command(args) -> dict:
    if any(args.round_trip_ms) and args.request_rate:
        raise SystemExit("--round-trip-ms is for the closed loop (no --request-rate)")
    if len(set(parse_range(args.output_len))) > 1 and "hf" in args.compare:
        raise SystemExit("--compare hf: one --output-len (transformers' batches share one length)")
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
                          cuda_graphs=not args.no_cuda_graphs, disable_overlap_scheduler=args.disable_overlap_scheduler,
                          late_planning=args.late_planning,
                          piecewise_graph_max_tokens=args.piecewise_graph_max_tokens,
                          max_batch_size=args.max_batch_size,
                          max_num_tokens=args.max_num_tokens, scheduler_policy=args.policy,
                          batching_type=args.batching, enable_chunked_prefill=not args.no_chunked_prefill,
                          kv_cache_config={"max_tokens": args.kv_tokens or None, "tokens_per_block": args.block_size,
                                           "enable_block_reuse": not args.no_reuse, "dtype": args.kv_cache_dtype},
                          tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                          quantization=args.quantization)
    if args.engine_process:
        return _engine_process_command(args, config)
    config.max_loras = max(config.max_loras, args.adapters)
    if args.adapters:  # slots as wide as the adapters, as a deployment sized for them would have
        config.max_lora_rank = args.lora_rank
    engine = LLMEngine(config)
    wl = synthetic(args.num_requests, args.input_len, args.output_len, engine.limits.vocab_size, args.seed,
                   args.ignore_eos, args.concurrency, args.request_rate, args.arrival)
    wl = replace(wl, temperature=args.temperature, top_p=args.top_p)
    engine.generate([[100] * 16], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up, on no prompt's tokens
    freeze_startup_heap()  # as the engine's serving processes do (app/heap.py)
    results = _round_trip_runs(lambda w, name: run_engine(engine, w, name), wl, engine.limits.vocab_size, args)
    if args.adapters:
        import tempfile

        from tools.bench.adapters import make_adapters
        names = list(make_adapters(engine.model_dir, Path(tempfile.mkdtemp()), args.adapters, args.lora_rank).items())
        load_times = _adapter_load_times(engine, names)
        wl.adapters = [names[i % len(names)][0] for i in range(wl.num_requests)]
        results.append(run_engine(engine, wl, f"ours, {args.adapters} adapters (rank {args.lora_rank})"))
        results[-1].extra = {**(results[-1].extra or {}), **load_times}
        print(", ".join(f"{key} {value:.1f}" for key, value in load_times.items()), flush=True)
        wl.adapters = None
    if args.guided:
        results += _guided_run(engine, wl, args.seed)
    if "hf" in args.compare:
        from tools.bench.hf_baseline import load_hf, run_sequential, run_static_batches
        model = load_hf(engine.model_dir, resolve_dtype(args.dtype, torch.device(args.device)), args.device,
                        dummy=args.load_format == "dummy")
        results.append(run_sequential(model, wl, min(args.hf_sequential_requests, wl.num_requests)))
        results.append(run_static_batches(model, wl))
    engine.shutdown()
    return _engine_report(args, results, str(engine.model_dir), str(engine.runner.shard.dtype))


def _round_trip_runs(run, wl, vocab: int, args) -> list:
    """A run of the workload per --round-trip-ms, each on prompts of its own (one run: as drawn)."""
    if args.round_trip_ms == [0.0]:
        return [run(wl, "ours")]
    return [run(replace(fresh_prompts(wl, vocab, run_seed(args.seed, "round trip", i, ms)), round_trip_s=ms / 1e3),
                f"ours, round trip {ms:g} ms") for i, ms in enumerate(args.round_trip_ms)]


def _engine_process_command(args, config: EngineConfig) -> dict:
    """The workload through the engine in a process of its own, as a GPU Engine replica runs it."""
    if args.adapters or args.guided or args.compare or config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        raise SystemExit("--engine-process: plain requests on one device (no --adapters, --guided, --compare, "
                         "--tp or --pp)")
    engine = EngineProcess(config)
    try:
        vocab = engine.limits.vocab_size
        wl = replace(synthetic(args.num_requests, args.input_len, args.output_len, vocab, args.seed, args.ignore_eos,
                               args.concurrency, args.request_rate, args.arrival),
                     temperature=args.temperature, top_p=args.top_p)
        run_engine_process(engine, Workload([[100] * 16], 4, False, None, 1), "warm-up")  # on no prompt's tokens
        results = _round_trip_runs(lambda w, name: run_engine_process(engine, w, f"{name}, engine process"), wl,
                                   vocab, args)
    finally:
        engine.shutdown()
    dtype = resolve_dtype(config.dtype, torch.device(config.device))
    return _engine_report(args, results, config.model, str(dtype))


def _engine_report(args, results: list, model_dir: str, dtype: str) -> dict:
    baseline = results[0] if len(args.round_trip_ms) > 1 else results[-1]  # round trips: against the first
    print(table(results, baseline=baseline.name if len(results) > 1 else None), flush=True)
    return {
        "command": "engine", "args": vars(args), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"},
        "model_dir": model_dir, "dtype": dtype, "results": [r.as_dict() for r in results],
    }


# A record every request's output must match: long enough for 128 tokens, bounded so each ends.
GUIDED_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 60}, "year": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 12},
    "rating": {"enum": ["low", "medium", "high"]}}, "required": ["title", "year", "tags", "rating"]}
GUIDED_SPEC = json.dumps(GUIDED_SCHEMA)  # as a workload's requests carry it
GUIDED_GUIDE = Guide("json_schema", GUIDED_SPEC, "bench")  # as the engine takes it


def _guided_run(engine: LLMEngine, wl, seed: int, run=run_engine) -> list:
    """The guided pair (_guided_pair) on the engine, with the schema's compile time cold (first
    sight) and cached (a repeat) in the guided result. `run`: how each run is run
    (run_engine's arguments; tools/bench/step_phases.py times the engine's phases around it)."""
    compiled = []
    for _ in range(2):
        start = time.perf_counter()
        engine.grammars.compile(GUIDED_GUIDE).result()
        compiled.append((time.perf_counter() - start) * 1e3)
    free, guided = _guided_pair(lambda w, name: run(engine, w, name), wl, engine.limits.vocab_size, seed, "ours")
    guided.extra = {**(guided.extra or {}), "compile_cold_ms": compiled[0], "compile_cached_ms": compiled[1]}
    print(f"schema compile: cold {compiled[0]:.1f} ms, cached {compiled[1]:.2f} ms", flush=True)
    return [free, guided]


def _guided_pair(run, wl, vocab: int, seed: int, label: str) -> list:
    """`run(workload, name)` with every request held to GUIDED_SCHEMA, then free again with each
    request as long as a guided answer was (an answer ends with its object, so the guided run has
    more, shorter requests: its baseline is the free run of the same lengths). Each run has prompts
    of its own, of the same lengths, that no earlier run cached. [free, guided]."""
    guided = run(replace(fresh_prompts(wl, vocab, run_seed(seed, label, "guided")), guide=GUIDED_SPEC),
                 f"{label}, JSON schema guided")
    free = run(replace(fresh_prompts(wl, vocab, run_seed(seed, label, "free")), output_lens=guided.output_lens,
                       ignore_eos=True), f"{label}, free, the guided lengths")
    return [free, guided]


def _adapter_load_times(engine: LLMEngine, names: list[tuple[str, Path]]) -> dict:
    """Registers the adapters, timing each (read, checked, folded; pinned where they go to device
    slots), and where slots exist times one copy into a slot: what a step pays when it brings an
    adapter that is not resident. Medians, in ms."""
    import statistics

    register = []
    for name, path in names:
        start = time.perf_counter()
        engine.add_lora(name, path)
        register.append(time.perf_counter() - start)
    times = {"adapter_register_ms_p50": statistics.median(register) * 1e3}
    loras = engine.runner.loras
    if loras.slots is not None:  # slot 1, before any step made an adapter resident there
        copies = []
        for name, _ in names[:8]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            loras.slots.load(1, loras.host[name])
            torch.cuda.synchronize()
            copies.append(time.perf_counter() - start)
        times["adapter_slot_copy_ms_p50"] = statistics.median(copies) * 1e3
    return times


def serve_command(args) -> dict:
    import asyncio
    import gc

    from app.config import load_config
    from app.engine.model_dir import resolve_model_dir
    from app.engine.model_loader import read_model_config
    from tools.bench.serve_runner import run_http, run_load

    config = load_config(args.config)
    vocab = read_model_config(resolve_model_dir(config.model)).vocab_size
    if args.seed is None:
        args.seed = random.randrange(1 << 31)
        print(f"prompts' seed: {args.seed}", flush=True)
    counts = args.num_requests or [None]
    if len(counts) not in (1, len(args.concurrency)):
        raise SystemExit("--num-requests takes one count, or one per --concurrency level")
    counts = counts * len(args.concurrency) if len(counts) == 1 else counts
    workloads = {c: replace(synthetic(n or max(8, 2 * c), args.input_len, args.output_len, vocab,
                                      run_seed(args.seed, c), args.ignore_eos, c, args.request_rate, args.arrival),
                            temperature=args.temperature, top_p=args.top_p)
                 for c, n in zip(args.concurrency, counts)}
    names = sorted(config.lora_adapters)[:args.adapters]
    if len(names) < args.adapters or (names and args.route != "openai" and not args.engine_only):
        raise SystemExit(f"--adapters {args.adapters}: the config registers {len(config.lora_adapters)} "
                         "(lora_adapters; tools/gpu/lora_config.py writes such a config); /v1 route only")
    if names and args.guided:
        raise SystemExit("--guided and --adapters: one at a time")
    spread = {c: replace(wl, adapters=[names[i % len(names)] for i in range(wl.num_requests)])
              for c, wl in workloads.items()} if names else {}
    label = f" {len(names)} adapters"
    results = []
    if args.compare_engine or args.engine_only:  # before the server exists, so that the two never share the cores
        engine = LLMEngine(config.engine_config())
        for adapter in names:
            engine.add_lora(adapter, config.lora_adapters[adapter])
        # The warm-up compiles the schema too: its cold compile (seconds) is not a level's to carry.
        engine.generate([[100] * 16], SamplingParams(max_tokens=4, temperature=0.0,
                                                     guide=GUIDED_GUIDE if args.guided else None))
        with startup_heap_frozen():  # as the engine's serving processes run (app/heap.py)
            for c, wl in workloads.items():
                if args.guided:
                    results += _guided_pair(lambda w, name: run_engine(engine, w, name), wl, vocab, args.seed,
                                            f"engine c={c}")
                    continue
                results.append(run_engine(engine, wl, f"engine c={c}"))
                if names:  # the base model and the adapters mixed, back to back on the same engine
                    results.append(run_engine(engine, spread[c], f"engine c={c}{label}"))
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():  # the caching allocator's blocks, for the server's engine
            torch.cuda.empty_cache()
    if not args.engine_only:
        url = args.url or _start_server(args.config, args.port)
        name = config.name
        warmup = replace(synthetic(args.warmup, "8", 4, vocab, 99, True, args.warmup),
                         guide=GUIDED_SPEC if args.guided else None)
        for c, wl in workloads.items():
            for p in dict.fromkeys(min(p, c) for p in args.client_processes):  # as given; at most one a stream
                asyncio.run(run_http(url, args.route, name, warmup, "warm-up"))
                run = f"dag {args.route} c={c}" + (f" x{p} clients" if p > 1 else "")
                # The server outlives this command: every run, on either route, brings prompts of its own.
                if args.guided:  # the pair draws prompts of its own
                    results += _guided_pair(lambda w, label: run_load(url, args.route, name, w, label, p), wl, vocab,
                                            run_seed(args.seed, args.route, c, p), run)
                    continue
                own = fresh_prompts(wl, vocab, run_seed(args.seed, args.route, c, p))
                results.append(run_load(url, args.route, name, own, run, p, args.request_stamps))
                if names:
                    results.append(run_load(url, args.route, name, replace(own, adapters=spread[c].adapters),
                                            run + label, p))
    print(table(results))
    if stages := stages_table(results):
        print(stages)
    device = torch.cuda.get_device_name() if torch.cuda.is_initialized() else config.device
    return {"command": "serve", "args": vars(args), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "machine": {"platform": platform.platform(), "torch": torch.__version__, "device": device,
                        "cpus": os.cpu_count()},
            "config": config.model_dump(), "results": [r.as_dict() for r in results]}


def _start_server(config_path: str, port: int) -> str:
    import ray
    from ray import serve

    from deployments.app import build_app

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"config": config_path}), name="llm", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("engine", help="our engine in-process, optionally against transformers")
    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--device", default="cpu")
    e.add_argument("--dtype", default="auto")
    e.add_argument("--no-cuda-graphs", action="store_true", help="CUDA: run decode steps eagerly")
    e.add_argument("--piecewise-graph-max-tokens", type=int, default=EngineConfig.piecewise_graph_max_tokens,
                   help="CUDA: steps with prefill chunks up to this many tokens replay piecewise graphs; 0: op by op")
    e.add_argument("--disable-overlap-scheduler", action="store_true",
                   help="CUDA: read each step back before scheduling the next")
    e.add_argument("--late-planning", action="store_true",
                   help="with overlap: plan each step just before the one computing ends (late_planning)")
    e.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from the model's config.json (e.g. configs/shapes/llama-3.1-8b)")
    e.add_argument("--num-requests", type=int, default=16)
    e.add_argument("--concurrency", type=int, default=16, help="most requests in flight at once")
    e.add_argument("--request-rate", type=float, default=None, help="requests/s (default: all at once)")
    e.add_argument("--arrival", choices=["exponential", "constant"], default="exponential")
    e.add_argument("--input-len", default="64:128", help="prompt tokens, N or LO:HI (uniform)")
    e.add_argument("--output-len", default="64", help="output tokens, N or LO:HI (uniform)")
    e.add_argument("--round-trip-ms", type=float, nargs="+", default=[0.0],
                   help="closed loop: a finished request's next one arrives this long after it ended (its "
                        "last step; with --engine-process, its last output's delivery): a client's round trip "
                        "through a serving path; several: a run each, on fresh prompts")
    e.add_argument("--engine-process", action="store_true",
                   help="run the engine in a process of its own and the workload over its pipe, as a GPU Engine "
                        "replica does (app/engine/engine_process.py), instead of in this process")
    e.add_argument("--ignore-eos", action="store_true")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (ranks as local processes)")
    e.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size")
    e.add_argument("--max-batch-size", type=int, default=EngineConfig.max_batch_size)
    e.add_argument("--max-num-tokens", type=int, default=EngineConfig.max_num_tokens)
    e.add_argument("--kv-tokens", type=int, default=65536, help="KV pool size; 0: free_gpu_memory_fraction of free memory")
    e.add_argument("--block-size", type=int, default=32)
    e.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="kv_cache_config.dtype")
    e.add_argument("--no-reuse", action="store_true")
    e.add_argument("--no-chunked-prefill", action="store_true")
    e.add_argument("--policy", default="GUARANTEED_NO_EVICT", choices=["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"])
    e.add_argument("--batching", default="INFLIGHT", choices=["INFLIGHT", "STATIC"])
    e.add_argument("--adapters", type=int, default=0, help="also run with requests spread over K LoRA adapters")
    e.add_argument("--guided", action="store_true", help="also run with every request held to a JSON schema")
    e.add_argument("--quantization", choices=["fp8"], default=None, help="the engine's quantization (EngineConfig)")
    e.add_argument("--lora-rank", type=int, default=8)
    e.add_argument("--compare", nargs="*", default=[], choices=["hf"])
    e.add_argument("--hf-sequential-requests", type=int, default=4,
                   help="how many requests the sequential baseline runs (its tokens/s is per request)")
    e.add_argument("--json", type=Path, default=None)
    s = sub.add_parser("serve", help="streaming HTTP load against the service, optionally against the bare engine")
    s.add_argument("--url", default=None, help="a running service; default: start one here from --config")
    s.add_argument("--config", "--start", dest="config", default="configs/smollm2-135m.yaml")
    s.add_argument("--port", type=int, default=8123)
    s.add_argument("--route", choices=["triton", "openai"], default="triton")
    s.add_argument("--warmup", type=int, default=2, help="requests sent at once before each level, not counted")
    s.add_argument("--adapters", type=int, default=0,
                   help="also run each level with requests spread over the config's first N lora_adapters (/v1)")
    s.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    s.add_argument("--num-requests", type=int, nargs="+", default=None,
                   help="per level, one count or one per --concurrency level (default: 2 x concurrency, >= 8)")
    s.add_argument("--request-rate", type=float, default=None)
    s.add_argument("--arrival", choices=["exponential", "constant"], default="exponential")
    s.add_argument("--input-len", default="64:128")
    s.add_argument("--output-len", default="64", help="output tokens, N or LO:HI (uniform)")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--seed", type=int, default=None,
                   help="the prompts' seed (default: a new one each time, recorded in the JSON: a server outlives "
                        "the command, and a second command on the same prompts would find their KV cached)")
    s.add_argument("--compare-engine", action="store_true")
    s.add_argument("--guided", action="store_true",
                   help="each level twice: every request held to a JSON schema, then free at the guided answers' lengths")
    s.add_argument("--engine-only", action="store_true", help="the engine levels alone, no server")
    s.add_argument("--client-processes", type=int, nargs="+", default=[1],
                   help="run each level from each of these numbers of load-generator processes, in this order")
    s.add_argument("--request-stamps", action="store_true",
                   help="keep each request's wall-clock stamps in the JSON (tools/bench/arrivals.py): the DAG's "
                        "plain runs on the Triton route, whose perf metrics carry the engine's stamps")
    s.add_argument("--json", type=Path, default=None)
    for p in (e, s):  # the main runs (engine, and the DAG's); adapter, guided and transformers runs stay greedy
        p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled, unseeded")
        p.add_argument("--top-p", type=float, default=1.0)
    args = parser.parse_args(argv)
    if args.command == "serve" and args.request_stamps and (args.route != "triton" or args.guided or args.adapters
                                                            or args.engine_only):
        parser.error("--request-stamps: the DAG's plain runs on --route triton only (not --guided, --adapters "
                     "or --engine-only)")
    report = engine_command(args) if args.command == "engine" else serve_command(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
