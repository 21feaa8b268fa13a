"""A real Ray Serve application on loopback, shared by the HTTP tests of a module."""
import socket

import httpx
import pytest
import yaml


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="package")
def server(tmp_path_factory, smollm2_dir):
    """Start the default DAG (smaller KV cache) and yield its base URL."""
    import ray
    from ray import serve

    from deployments.app import build_app

    config = yaml.safe_load(open("configs/smollm2-135m.yaml"))
    config["kv_cache_config"]["max_tokens"] = 16384
    config["max_seq_len"] = 2048
    path = tmp_path_factory.mktemp("serve") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"config": str(path)}), name="llm", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    httpx.get(f"{url}/v2/health/ready", timeout=60).raise_for_status()
    yield url
    serve.shutdown()
    ray.shutdown()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server, timeout=120) as client:
        yield client
