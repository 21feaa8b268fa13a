#!/usr/bin/env bash
# Set up, then serve the default application (SmolLM2-135M-Instruct) on localhost:8000.
# With RAY_ADDRESS unset it starts its own one-node Ray with its ports on loopback and stops it on
# exit; with RAY_ADDRESS it deploys to that cluster (docs/SECURITY.md says what that cluster needs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

# Serve's proxy applies the connection limits (deployments/proxy_guard.py). Ray passes this
# environment from `ray start` to the proxy, which must import this repository.
export RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.proxy_guard:install
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [[ -n "${RAY_ADDRESS:-}" ]]; then
    exec .venv/bin/serve run serve_config.yaml "$@"
fi

# What an idle app costs a CPU engine on the same host (docs/PERFORMANCE.md). Serve's controller
# runs its control loop every 0.1 s by default, with three GCS calls each time: every 0.5 s cuts
# what the controller and the GCS use while idle by more than half, and replacing a dead replica
# takes about 1 s longer (autoscaling delays are kept in wall-clock time). Replicas and the proxy
# hand their cached Serve metrics to Ray every 0.1 s by default; Ray exports metrics every 10 s
# (1 s at the least), so once a second loses nothing.
export RAY_SERVE_CONTROL_LOOP_INTERVAL_S=${RAY_SERVE_CONTROL_LOOP_INTERVAL_S:-0.5}
export RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=${RAY_SERVE_METRICS_EXPORT_INTERVAL_MS:-1000}

# `ray start` turns --node-ip-address=127.0.0.1 into the host's address, and its GCS, raylet and
# agents then listen on every interface. Ray's switch for one-node clusters (meant for macOS and
# Windows) keeps the node on 127.0.0.1, where they listen on loopback.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
# Its own temp dir (mode 700): a `ray.init()` elsewhere on this host must not find and join this node.
ray_dir=$(mktemp -d /tmp/llm-serve-ray.XXXXXX)
# Loopback is open to every user of this host, and Serve's replicas listen on every interface
# whatever the node's address: Ray's token authentication refuses them all without this token.
.venv/bin/python -c 'import secrets; print(secrets.token_hex(32))' >"$ray_dir/auth_token"
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$ray_dir/auth_token"
gcs_port=$(.venv/bin/python -c 'from app.engine.executor import free_port; print(free_port("127.0.0.1"))')
export RAY_ADDRESS="127.0.0.1:$gcs_port"

.venv/bin/ray start --head --block --node-ip-address=127.0.0.1 --port="$gcs_port" \
    --dashboard-host=127.0.0.1 --temp-dir="$ray_dir" --disable-usage-stats >"$ray_dir/ray-start.log" 2>&1 &
head_pid=$!
# SIGTERM makes `ray start --block` stop every process of its node (`ray stop` would stop every Ray
# node of this user on the host). The logs stay; the token goes with the node.
trap 'kill "$head_pid" 2>/dev/null; wait "$head_pid" 2>/dev/null || true; rm -f "$ray_dir/auth_token"' EXIT
until .venv/bin/ray status --address="$RAY_ADDRESS" >/dev/null 2>&1; do
    kill -0 "$head_pid" 2>/dev/null || { cat "$ray_dir/ray-start.log" >&2; exit 1; }
    sleep 1
done
echo "Ray on loopback at $RAY_ADDRESS; its logs are under $ray_dir" >&2

# In the background, so that a SIGTERM to this script is handled at once; `env` restores the SIGINT
# that bash ignores in background commands, so Ctrl-C reaches it as usual. On either, `serve run`
# shuts Serve down, and then the node stops.
env --default-signal=INT .venv/bin/serve run serve_config.yaml "$@" &
serve_pid=$!
trap 'kill -INT "$serve_pid" 2>/dev/null' TERM
trap : INT  # Ctrl-C reached `serve run` too: let it finish shutting down
wait "$serve_pid" || wait "$serve_pid"  # a trapped signal ends the first wait early: wait again
