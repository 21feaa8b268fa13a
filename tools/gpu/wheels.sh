#!/usr/bin/env bash
# Here, with network: the wheels that the device machine (Python 3.12, x86-64, torch and
# transformers installed, no network) lacks for the whole app, in three carries (.whl/1-3), each of
# which must fit beside the repository's tracked files in the 64 MiB a call carries: the ray wheel
# (79 MB) split in two (.whl/1 and .whl/2), pydantic's wheels with the first half (the engine-alone
# run needs them before ray is complete), every other wheel in the carry with the most room.
# tools/gpu/serve_bench.sh's `stash` copies each carry to /tmp there and `install` joins the ray
# wheel and installs offline. Pins follow requirements.txt (ray[serve]==2.60.0) and the dev venv.
# /.whl/ is ignored by git; nothing here is committed.
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP=${PIP:-$( [[ -x .venv/bin/python ]] && echo ".venv/bin/python -m pip" || echo "python3 -m pip")}
# What the machine's image already has at versions that fit (seen there 2026-11-26: numpy 2.5,
# uvloop 0.23); pip there keeps its own copy and these would only take room in the carry. Its
# aiohttp (3.14.3) is older than ray[serve] 2.60 accepts, so that wheel travels.
ON_DEVICE=${ON_DEVICE:-"numpy uvloop"}
dl=.whl/download
parts=(.whl/1 .whl/2 .whl/3)
rm -rf "${parts[@]}" && mkdir -p "$dl" "${parts[@]}"
$PIP download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dl" \
    "ray[serve]==2.60.0" "pydantic==2.14.4" "py-spy==0.4.3" 2> >(grep -v "is ignored: it is neither" >&2)
# Guided decoding's grammar engine, without its dependencies, as scripts/setup.sh installs it (its
# own wheel asks for triton and others the machine has; its runtime, apache-tvm-ffi, it does not).
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 -d "$dl" "xgrammar==0.2.8" "apache-tvm-ffi==0.1.15.post2" \
    2> >(grep -v "is ignored: it is neither" >&2)
size() { du -sb "$1" | cut -f1; }
ray=$(basename "$dl"/ray-*.whl)
split -b 40M "$dl/$ray" ".whl/1/$ray.part-"
mv ".whl/1/$ray.part-ab" .whl/2/
[[ -e .whl/1/$ray.part-ac ]] && { echo "the ray wheel needs a third part" >&2; exit 1; }
for whl in $(ls -S "$dl"/*.whl); do  # largest first, each to the carry with the most room
  name=$(basename "$whl" | cut -d- -f1 | tr '[:upper:]_' '[:lower:]-')
  [[ $name == ray || " $ON_DEVICE " == *" $name "* ]] && continue
  part=.whl/1
  if [[ ! " pydantic pydantic-core annotated-types typing-inspection typing-extensions " == *" $name "* ]]; then
    for p in "${parts[@]}"; do (( $(size "$p") < $(size "$part") )) && part=$p; done
  fi
  cp "$whl" "$part/"
done
# A call carries the tracked files too: each carry must fit beside them.
tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)  # one du: xargs may split the list, and its totals
for p in "${parts[@]}"; do
  total=$(( $(size "$p") + tree ))
  echo "$p: $(( $(size "$p") >> 20 )) MiB of wheels, $(( total >> 20 )) MiB with the tracked files"
  (( total < 63 << 20 )) || { echo "$p does not fit in a call's 64 MiB beside the tracked files" >&2; exit 1; }
done
