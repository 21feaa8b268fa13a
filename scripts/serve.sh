#!/usr/bin/env bash
# Set up, then serve the default application (SmolLM2-135M-Instruct) on localhost:8000.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/serve run serve_config.yaml "$@"
