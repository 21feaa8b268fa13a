#!/usr/bin/env bash
# Set up, then run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# --durations: the slowest tests close the log, so a suite that grows slow shows where.
exec .venv/bin/python -m pytest -q --durations=25 "$@"
