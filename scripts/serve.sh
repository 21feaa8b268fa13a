#!/usr/bin/env bash
# Set up, then answer a question with the embedded model (the Ray Serve app replaces this demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python tools/demo.py "$@"
