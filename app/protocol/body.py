"""A request body from bytes to JSON, with the checks json.loads does not make.

- Depth: JSON nested 100,000 deep makes json.loads raise RecursionError (a 500 unless caught), and
  no route takes more than a few levels.
- Unicode: JSON's "\\ud800" escape decodes to a lone surrogate, a str that nothing downstream can
  encode (the tokenizer, Ray's serialization of an adapter name, the JSON of an error echoing it).
- Numbers: Python's json reads NaN and Infinity (and 1e999 as Infinity); no field takes them.
Every refusal names the field by its path in the body (`messages.0.content`).
"""
from __future__ import annotations

import json
import math
from typing import Annotated, Any

from pydantic import Field, Strict

from app.engine.errors import InvalidRequestError

MAX_DEPTH = 32  # the deepest route (chat messages, KServe tensors of lists) needs 5
# A token id as a client sends it: an integer (not true, 1.0 or "1"), in a range every tokenizer can
# decode (the engine then checks the model's vocabulary); -1 made the echo's decode raise.
TOKEN_ID_LIMIT = 2 ** 31
TokenId = Annotated[int, Strict(), Field(ge=0, lt=TOKEN_ID_LIMIT)]


def parse_body(raw: bytes, max_depth: int = MAX_DEPTH) -> Any:
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidRequestError("body", f"is nested deeper than {max_depth} levels") from None
    except ValueError:  # UnicodeDecodeError (bytes that are not UTF-8) is one too
        raise InvalidRequestError("body", "is not valid JSON") from None
    check_value(data, "body", max_depth)
    return data


def check_value(value: Any, where: str, max_depth: int = MAX_DEPTH) -> None:
    """Raise InvalidRequestError for the first string with a lone surrogate, non-finite number or
    level past max_depth in `value`; `where` names value itself."""
    stack = [(value, where, 0)]
    while stack:
        node, where, depth = stack.pop()
        if isinstance(node, str):
            if not _is_unicode(node):
                raise InvalidRequestError(where, "contains a lone UTF-16 surrogate, which is not valid Unicode")
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise InvalidRequestError(where, "must be a finite number (NaN and Infinity are not JSON numbers)")
        elif isinstance(node, (dict, list)):
            if depth >= max_depth:
                raise InvalidRequestError(where, f"is nested deeper than {max_depth} levels")
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, child in items:
                if isinstance(key, str) and not _is_unicode(key):
                    raise InvalidRequestError(where, "has a key with a lone UTF-16 surrogate, which is not valid Unicode")
                stack.append((child, key if where == "body" else f"{where}.{key}", depth + 1))


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
