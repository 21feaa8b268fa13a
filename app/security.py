"""What every HTTP request must pass before any stage sees it: the API key and the body size."""
from __future__ import annotations

import hmac
import os
import re

# Health stays open: load balancers and Serve's own probes carry no key.
OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready", "/-/healthz", "/-/routes"})
MODEL_READY = re.compile(r"/v2/models/[^/]+(/versions/[^/]+)?/ready")  # KServe's per-model health probe


def api_key(configured: str | None) -> str | None:
    """The key from the config, else from LLM_SERVE_API_KEY (keeps secrets out of config files)."""
    return configured or os.environ.get("LLM_SERVE_API_KEY") or None


def refusal(path: str, headers: dict[str, str], key: str | None, max_bytes: int) -> tuple[int, str] | None:
    """(status, message) when the request must be refused, else None. `headers` keys are lower case."""
    if key is not None and path not in OPEN_PATHS and not MODEL_READY.fullmatch(path):
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            return 401, "authorization: send 'Authorization: Bearer <api key>'"
    length = headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            return 400, "content-length: must be a number of bytes"
        if int(length) > max_bytes:
            return 413, f"body: {length} bytes exceed the limit of {max_bytes}"
    return None
