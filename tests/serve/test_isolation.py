"""No request can hurt the others: hostile requests sent into a full batch are refused alone, and
the 64 streams beside them finish exactly as they do without them."""
import concurrent.futures
import json
import shutil

import httpx

STREAMS = 64


def _broken_adapter(lora_root) -> str:
    """A PEFT adapter whose tensors have rank 5 while its config says 4 (it killed the engine loop)."""
    target = lora_root / "broken-rank"
    if not target.exists():
        shutil.copytree(lora_root / "sql", target)
        config = json.loads((target / "adapter_config.json").read_text())
        config["r"] = config["r"] - 1
        (target / "adapter_config.json").write_text(json.dumps(config))
    return str(target)


def _hostile(lora_root) -> list[tuple[str, bytes]]:
    body = {"text_input": "Hi", "max_tokens": 4}
    return [
        ("/v2/models/ensemble/generate", json.dumps({**body, "top_k": 2 ** 63}).encode()),
        ("/v1/completions", json.dumps({"model": "smollm2-135m", "prompt": "Hi", "top_k": 2 ** 64}).encode()),
        ("/v2/models/ensemble/generate", b'{"text_input": "Hi", "max_tokens": 4, "lora_task_id": "\\ud800"}'),
        ("/v2/models/ensemble/generate", json.dumps({**body, "lora_task_id": "broken",
                                                     "lora_path": _broken_adapter(lora_root)}).encode()),
        ("/v2/models/ensemble/generate", json.dumps({**body, "num_return_sequences": 10_000}).encode()),
        ("/v2/models/ensemble/generate", json.dumps({**body, "seed": 2 ** 64, "temperature": 0.7}).encode()),
        ("/v2/models/ensemble/generate", json.dumps({**body, "stop_words": ["x"] * 60_000}).encode()),
        ("/v2/models/ensemble/generate", b"[" * 100_000),
        ("/v2/models/ensemble/infer", json.dumps({"inputs": [{"name": ["text_input"], "data": ["Hi"]}]}).encode()),
    ]


def _greedy(client, i):
    r = client.post("/v2/models/ensemble/generate", json={"text_input": f"Count from {i}:", "max_tokens": 8})
    assert r.status_code == 200, r.text
    return r.json()["text_output"]


def test_hostile_requests_inside_a_full_batch_hurt_no_other(server, lora_root):
    with httpx.Client(base_url=server, timeout=300) as client, \
            concurrent.futures.ThreadPoolExecutor(STREAMS + 16) as pool:
        alone = list(pool.map(lambda i: _greedy(client, i), range(STREAMS)))
        greedy = [pool.submit(_greedy, client, i) for i in range(STREAMS)]
        hostile = [pool.submit(client.post, path, content=raw) for path, raw in _hostile(lora_root)]
        beside = [f.result() for f in greedy]
        refused = [f.result() for f in hostile]
        assert beside == alone
        assert all(400 <= r.status_code < 500 for r in refused), [(r.status_code, r.text[:200]) for r in refused]
        assert client.get("/v2/health/ready").status_code == 200
        stats = client.get("/stats").json()
        assert stats["healthy"] and stats["used_blocks"] == 0
