#!/usr/bin/env bash
# Tensor parallelism on a two-GPU device machine (kind nvidia-h100-x2), one call: the GPU tests
# (TP=2 equals TP=1), then the Llama-3.1-8B shape, bf16 dummy weights, TP=1 beside TP=2.
# Every step has its own time limit and its log in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-gpu-results}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpu.txt"
timeout 240 python -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py > "$out/tests.log" 2>&1
echo "tests rc=$?" >> "$out/tests.log"
bench() { timeout 150 python tools/benchmark.py engine --load-format dummy --device cuda --dtype bfloat16 \
          --ignore-eos --model configs/shapes/llama-3.1-8b "$@"; }
for tp in 1 2; do
  bench --tp $tp --num-requests 2 --concurrency 1 --input-len 128 --output-len 128 \
        --json "$out/tp$tp-b1.json" > "$out/bench.log" 2>&1
  bench --tp $tp --num-requests 256 --concurrency 256 --max-batch-size 256 --max-num-tokens 8192 \
        --kv-tokens 131072 --input-len 128 --output-len 128 --json "$out/tp$tp-256.json" >> "$out/bench.log" 2>&1
  grep -A3 "^run" "$out/bench.log" > "$out/bench-tp$tp.txt"
done
