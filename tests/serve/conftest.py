"""A real Ray Serve application on loopback, shared by the HTTP tests of a module."""
import os
from pathlib import Path

import httpx
import pytest
import yaml

from app.engine.executor import free_port


def _write_config(tmp_path_factory, lora_root, **overrides):
    config = yaml.safe_load(open("configs/smollm2-135m.yaml"))
    # 8,192 tokens of KV (384 MiB) per engine: a CI run holds many apps at once on a 24 GiB machine,
    # and Ray's memory monitor kills workers (even the Serve controller) near 95% used.
    config["kv_cache_config"]["max_tokens"] = 8192
    config["max_seq_len"] = 2048
    config["max_tokens_default"] = 64  # answers that name no max_tokens stay short (shipped: to the context's end)
    config["lora_roots"] = [str(lora_root)]
    config["lora_adapters"] = {"sql": "sql"}
    for key, value in overrides.items():
        config[key] = value
    path = tmp_path_factory.mktemp("serve") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="package")
def server(tmp_path_factory, smollm2_dir, lora_root):
    """Start the default DAG (smaller KV cache, adapters under lora_root) and yield its base URL."""
    import ray
    from ray import serve

    from deployments.app import build_app

    path = _write_config(tmp_path_factory, lora_root)
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")  # metrics reach the scrape endpoint in ~1 s
    # Every test runs behind the connection limits (docs/SECURITY.md); tests/serve/test_connections.py
    # floods past this cap and waits out this body timeout.
    os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "deployments.proxy_guard:install")
    os.environ.setdefault("LLM_SERVE_MAX_CONNECTIONS", "1000")
    os.environ.setdefault("LLM_SERVE_BODY_TIMEOUT_S", "5")
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    port = free_port("127.0.0.1")  # chosen once Ray's processes hold their ports
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"config": str(path)}), name="llm", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    httpx.get(f"{url}/v2/health/ready", timeout=60).raise_for_status()
    yield url
    serve.shutdown()
    ray.shutdown()


def run_with_replicas(tmp_path_factory, lora_root, stage: str, replicas: int, name: str) -> str:
    """Another application on the shared Serve instance, whose `stage` has `replicas` replicas,
    served as smollm2-<name> under /<name>; returns that route prefix."""
    from ray import serve

    from deployments.app import build_app

    stages = yaml.safe_load(open("configs/smollm2-135m.yaml"))["serve"]
    stages[stage]["num_replicas"] = replicas
    path = _write_config(tmp_path_factory, lora_root, served_model_name=f"smollm2-{name}", serve=stages)
    serve.run(build_app({"config": str(path)}), name=name, route_prefix=f"/{name}")
    return f"/{name}"


@pytest.fixture(scope="package")
def two_engine_server(server, tmp_path_factory, lora_root):
    """A second application on the same Serve instance: two engine replicas, for routing tests."""
    return server + run_with_replicas(tmp_path_factory, lora_root, "engine", 2, "two")


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server, timeout=120) as client:
        yield client


@pytest.fixture(scope="package")
def small_queue_server(server, tmp_path_factory, lora_root):
    """A third application whose engine takes one request at a time and queues one more."""
    from ray import serve

    from deployments.app import build_app

    stages = yaml.safe_load(open("configs/smollm2-135m.yaml"))["serve"]
    stages["engine"].update(max_ongoing_requests=1, max_queued_requests=1)
    path = _write_config(tmp_path_factory, lora_root, served_model_name="smollm2-small", serve=stages)
    serve.run(build_app({"config": str(path)}), name="small", route_prefix="/small")
    return f"{server}/small"


FAKES = Path(__file__).resolve().parents[1] / "fakes"
ROOT = Path(__file__).resolve().parents[2]


def _fake_backend_app(server, tmp_path_factory, lora_root, smollm2_dir, backend: str):
    """The same DAG on a production backend's fake (tests/fakes), at /<backend> on the same Serve;
    deleted after its module (each app's engine holds a model and a KV cache in memory)."""
    from ray import serve

    from deployments.app import build_app

    stages = yaml.safe_load(open("configs/smollm2-135m.yaml"))["serve"]
    stages["engine"]["env_vars"] = {"PYTHONPATH": f"{FAKES}:{ROOT}"}  # the engine replica imports the fake
    extra = {"triton": {"engine_dir": str(smollm2_dir)}} if backend == "triton" else {}
    path = _write_config(tmp_path_factory, lora_root, served_model_name=f"smollm2-{backend}", backend=backend,
                         serve=stages, kv_cache_config={"max_tokens": 4096}, **extra)
    serve.run(build_app({"config": str(path)}), name=backend, route_prefix=f"/{backend}")
    yield f"{server}/{backend}"
    serve.delete(backend)


@pytest.fixture(scope="module")
def trtllm_server(server, tmp_path_factory, lora_root, smollm2_dir):
    yield from _fake_backend_app(server, tmp_path_factory, lora_root, smollm2_dir, "trtllm")


@pytest.fixture(scope="module")
def triton_server(server, tmp_path_factory, lora_root, smollm2_dir):
    yield from _fake_backend_app(server, tmp_path_factory, lora_root, smollm2_dir, "triton")
