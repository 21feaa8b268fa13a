#!/usr/bin/env bash
# The GPU measurements behind docs/PERFORMANCE.md, in one call on the device machine (torch and
# transformers come with its image): the engine's GPU checks, the kernels alone, then our engine
# beside transformers on dummy-weight shapes, bf16. Each step has its own time limit and log, so a
# hang costs one step, not the call. The steps together outrun one 10-minute call: name the ones
# to run, e.g. `STEPS="tests kernels smollm2-b1" bash tools/bench/gpu_suite.sh` (default: all).
# Results land in $OUT (or ./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-gpu-results}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
step() {
  local limit=$1 name=$2; shift 2
  [[ -z "${STEPS:-}" || " $STEPS " == *" $name "* ]] || return 0
  timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "$name rc=$?"; tail -3 "$out/$name.log"
}
bench=(python tools/benchmark.py engine --load-format dummy --device cuda --dtype bfloat16 --ignore-eos)
step 300 tests python -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py
step 240 kernels python -m tools.bench.kernels --json "$out/kernels.json"
step 120 smollm2-b1 "${bench[@]}" --model configs/shapes/smollm2-135m --num-requests 4 --concurrency 1 --input-len 128 \
     --output-len 128 --json "$out/smollm2-b1.json"
step 240 llama8b-b1 "${bench[@]}" --model configs/shapes/llama-3.1-8b --num-requests 2 --concurrency 1 --input-len 128 \
     --output-len 128 --compare hf --hf-sequential-requests 1 --json "$out/llama8b-b1.json"
step 300 llama8b-1024 "${bench[@]}" --model configs/shapes/llama-3.1-8b --num-requests 1024 --concurrency 1024 \
     --max-batch-size 512 --max-num-tokens 8192 --kv-tokens 262144 --input-len 128 --output-len 128 \
     --json "$out/llama8b-1024.json"
step 420 llama8b-1000 "${bench[@]}" --model configs/shapes/llama-3.1-8b --num-requests 512 --concurrency 512 \
     --max-batch-size 512 --max-num-tokens 8192 --kv-tokens 380000 --input-len 1000 --output-len 1000 \
     --json "$out/llama8b-1000x1000.json"
step 420 llama8b-1000-fraction "${bench[@]}" --model configs/shapes/llama-3.1-8b --num-requests 512 \
     --concurrency 512 --max-batch-size 512 --max-num-tokens 8192 --kv-tokens 0 --input-len 1000 --output-len 1000 \
     --json "$out/llama8b-1000x1000-fraction.json"
