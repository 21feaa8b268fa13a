#!/usr/bin/env bash
# The GPU measurements behind docs/PERFORMANCE.md, in one call on the device machine (torch and
# transformers come with its image): the engine's GPU checks, the kernels alone, then our engine
# beside transformers on dummy-weight shapes, bf16. Each step has its own time limit and log, so a
# hang costs one step, not the call. The steps together outrun one 10-minute call: name the ones
# to run, e.g. `STEPS="tests kernels smollm2-b1" bash tools/bench/gpu_suite.sh` (default: all).
# BASE=<dir> also runs every benchmark step over another tree of this repo (e.g. main, from
# `git archive main | tar -x -C .base`) just before this one, on the same card in the same call:
# the before/after pair, as <step>-base.json beside <step>.json. BASE_FLAGS adds arguments to those
# baseline runs (with BASE unset, over this same tree), e.g. BASE_FLAGS=--disable-overlap-scheduler.
# Results land in ./gpu-results; where the device tool's $OUT is set they come back packed as
# $OUT/gpu-results.tgz (it returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD out=$PWD/gpu-results
rm -rf "$out"; mkdir -p "$out"
[[ -n "${OUT:-}" ]] && trap 'tar czf "$OUT/gpu-results.tgz" -C "$root" gpu-results' EXIT
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
wanted() { [[ -z "${STEPS:-}" || " $STEPS " == *" $1 "* ]]; }
run() {  # limit log dir command...: one step, in one tree
  local limit=$1 log=$2 dir=$3; shift 3
  (cd "$dir" && PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" timeout "$limit" "$@") > "$log" 2>&1
  echo "$(basename "$log" .log) rc=$?"; tail -3 "$log"
}
step() {  # limit name command...
  local limit=$1 name=$2; shift 2
  wanted "$name" && run "$limit" "$out/$name.log" "$root" "$@"
}
bench_step() {  # limit name benchmark arguments...
  local limit=$1 name=$2; shift 2
  wanted "$name" || return 0
  [[ -n "${BASE:-}${BASE_FLAGS:-}" ]] && run "$limit" "$out/$name-base.log" "${BASE:-$root}" "${bench[@]}" "$@" \
      ${BASE_FLAGS:-} --json "$out/$name-base.json"
  run "$limit" "$out/$name.log" "$root" "${bench[@]}" "$@" --json "$out/$name.json"
}
bench=(python tools/benchmark.py engine --load-format dummy --device cuda --dtype bfloat16 --ignore-eos)
step 300 tests python -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py
step 240 kernels python -m tools.bench.kernels --json "$out/kernels.json"
bench_step 120 smollm2-b1 --model configs/shapes/smollm2-135m --num-requests 4 --concurrency 1 --input-len 128 \
     --output-len 128
bench_step 240 llama8b-b1 --model configs/shapes/llama-3.1-8b --num-requests 2 --concurrency 1 --input-len 128 \
     --output-len 128
step 240 llama8b-b1-hf "${bench[@]}" --model configs/shapes/llama-3.1-8b --num-requests 2 --concurrency 1 \
     --input-len 128 --output-len 128 --compare hf --hf-sequential-requests 1 --json "$out/llama8b-b1-hf.json"
bench_step 300 llama8b-1024 --model configs/shapes/llama-3.1-8b --num-requests 1024 --concurrency 1024 \
     --max-batch-size 512 --max-num-tokens 8192 --kv-tokens 262144 --input-len 128 --output-len 128
bench_step 420 llama8b-1000 --model configs/shapes/llama-3.1-8b --num-requests 512 --concurrency 512 \
     --max-batch-size 512 --max-num-tokens 8192 --kv-tokens 380000 --input-len 1000 --output-len 1000
# The pool sized from free_gpu_memory_fraction once the graphs are in place (no BASE: older trees size it first).
step 420 llama8b-1000-fraction "${bench[@]}" --model configs/shapes/llama-3.1-8b --num-requests 512 \
     --concurrency 512 --max-batch-size 512 --max-num-tokens 8192 --kv-tokens 0 --input-len 1000 --output-len 1000 \
     --json "$out/llama8b-1000-fraction.json"
# Multi-LoRA: the base model, then requests spread over K random adapters of one rank on all seven
# projections, on the same engine with the same prompts (slots as wide as the rank).
lora_step() {  # name adapters rank concurrency requests
  bench_step 420 "$1" --model configs/shapes/llama-3.1-8b --num-requests "$5" --concurrency "$4" \
      --max-batch-size 256 --input-len 128 --output-len 128 --adapters "$2" --lora-rank "$3"
}
lora_step lora-8x16 8 16 256 512
lora_step lora-32x16 32 16 256 512
lora_step lora-8x8 8 8 256 512
lora_step lora-64x16 64 16 256 512
lora_step lora-8x64 8 64 256 512
lora_step lora-b1 1 16 1 4
# Guided decoding: every request held to a JSON schema, beside the free run on the same engine.
# Needs xgrammar importable (carry its wheels: pip install --no-deps --target /tmp/xg, PYTHONPATH)
# and the shape's tokenizer (python tools/gpu/make_tokenizer.py configs/shapes/llama-3.1-8b).
bench_step 300 guided-64 --model configs/shapes/llama-3.1-8b --num-requests 256 --concurrency 64 \
     --max-batch-size 64 --input-len 128 --output-len 128 --guided
# Where a decode step's time goes (kernels by GPU time), over BASE too where it is set (copy
# tools/bench/profile_steps.py into a BASE tree older than it).
profile_step() {  # name model batch
  wanted "$1" || return 0
  local command=(python -m tools.bench.profile_steps --model "$2" --batch "$3")
  [[ -n "${BASE:-}${BASE_FLAGS:-}" ]] && run 240 "$out/$1-base.log" "${BASE:-$root}" "${command[@]}" ${BASE_FLAGS:-}
  run 240 "$out/$1.log" "$root" "${command[@]}"
}
profile_step profile-smollm2 configs/shapes/smollm2-135m 1
profile_step profile-llama8b configs/shapes/llama-3.1-8b 1
profile_step profile-llama8b-512 configs/shapes/llama-3.1-8b 512
