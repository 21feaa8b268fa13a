"""Request-body schemas for the OpenAPI document of routes that parse their body themselves (to
name the bad field in their own error format): clients and fuzzers see what the routes take."""
from __future__ import annotations

from pydantic import BaseModel


def _inline(node, defs: dict):
    """The schema with every local $ref replaced by its definition (OpenAPI resolves '#/...'
    against the whole document, so pydantic's '#/$defs/...' must not stay)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def body(schema: type[BaseModel]) -> dict:
    """`openapi_extra` for a route whose JSON body follows `schema`."""
    raw = schema.model_json_schema()
    resolved = _inline(raw, raw.get("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": resolved}}}}
