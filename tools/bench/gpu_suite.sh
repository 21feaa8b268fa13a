#!/usr/bin/env bash
# The GPU measurements behind docs/PERFORMANCE.md, in one call on the device machine (torch and
# transformers come with its image): the engine's GPU checks, then our engine beside transformers
# on dummy-weight shapes, bf16. Results land in $OUT (or ./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-gpu-results}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py 2>&1 | tail -4
bench() { python tools/benchmark.py engine --load-format dummy --device cuda --dtype bfloat16 --ignore-eos "$@"; }
bench --model configs/shapes/smollm2-135m --num-requests 4 --concurrency 1 --input-len 128 --output-len 128 \
      --json "$out/smollm2-b1.json" 2>&1 | tail -4
bench --model configs/shapes/smollm2-135m --num-requests 4 --concurrency 1 --input-len 128 --output-len 128 \
      --no-cuda-graphs 2>&1 | tail -3
bench --model configs/shapes/llama-3.1-8b --num-requests 2 --concurrency 1 --input-len 128 --output-len 128 \
      --compare hf --hf-sequential-requests 1 --json "$out/llama8b-b1.json" 2>&1 | tail -6
bench --model configs/shapes/llama-3.1-8b --num-requests 256 --concurrency 256 --max-batch-size 256 \
      --max-num-tokens 8192 --kv-tokens 131072 --input-len 128 --output-len 128 --compare hf \
      --hf-sequential-requests 1 --json "$out/llama8b-256.json" 2>&1 | tail -6
bench --model configs/shapes/llama-3.1-8b --num-requests 1024 --concurrency 1024 --max-batch-size 512 \
      --max-num-tokens 8192 --kv-tokens 262144 --input-len 128 --output-len 128 \
      --json "$out/llama8b-1024.json" 2>&1 | tail -4
bench --model configs/shapes/llama-3.1-8b --num-requests 512 --concurrency 512 --max-batch-size 512 \
      --max-num-tokens 8192 --kv-tokens 700000 --input-len 1000 --output-len 1000 \
      --json "$out/llama8b-1000x1000.json" 2>&1 | tail -4
