#!/usr/bin/env bash
# Set up, then run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Python's fault handler from the start: pytest's own is removed once the session ends, and a crash
# after that (a native thread at interpreter exit) would otherwise print nothing but "Segmentation fault".
PYTHONFAULTHANDLER=1 exec .venv/bin/python -m pytest -q "$@"
