"""The request guard: API key on every route but health, body size from Content-Length."""
from app.security import api_key, refusal

KEY = "s3cret"


def test_key_is_required_but_not_for_health():
    assert refusal("/v2/models/ensemble/generate", {}, KEY, 1024)[0] == 401
    assert refusal("/v1/models", {"authorization": "Bearer nope"}, KEY, 1024)[0] == 401
    assert refusal("/v1/models", {"authorization": f"Basic {KEY}"}, KEY, 1024)[0] == 401
    assert refusal("/v1/models", {"authorization": f"Bearer {KEY}"}, KEY, 1024) is None
    assert refusal("/v1/models", {"authorization": f"bearer  {KEY}"}, KEY, 1024) is None
    assert refusal("/v2/health/ready", {}, KEY, 1024) is None
    assert refusal("/v2/models/ensemble/ready", {}, KEY, 1024) is None  # KServe's model health, like the server's
    assert refusal("/v2/models/ensemble/versions/1/ready", {}, KEY, 1024) is None
    assert refusal("/v2/models/ensemble/ready/x", {}, KEY, 1024)[0] == 401
    assert refusal("/v1/models", {}, None, 1024) is None  # no key configured: open


def test_body_size_from_content_length():
    status, message = refusal("/v1/completions", {"content-length": "2048"}, None, 1024)
    assert status == 413 and message.startswith("body:") and "1024" in message
    assert refusal("/v1/completions", {"content-length": "1024"}, None, 1024) is None
    assert refusal("/v1/completions", {"content-length": "-5"}, None, 1024)[0] == 400


def test_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("LLM_SERVE_API_KEY", "from-env")
    assert api_key(None) == "from-env" and api_key("from-config") == "from-config"
    monkeypatch.delenv("LLM_SERVE_API_KEY")
    assert api_key(None) is None
