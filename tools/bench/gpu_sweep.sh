#!/usr/bin/env bash
# The sweep behind docs/gpu-sweep.png in one device call: Llama-3.1-8B shape, bf16, dummy weights.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-gpu-results}; mkdir -p "$out"
timeout 420 python -m tools.bench.sweep --json "$out/sweep.json" > "$out/sweep.log" 2>&1
python -m tools.bench.plot_sweep "$out/sweep.json" "$out/gpu-sweep.png" >> "$out/sweep.log" 2>&1
grep -E "tok/s|failed" "$out/sweep.log"
