"""OpenAI-compatible /v1 shapes: models, completions, chat completions (streaming and not)."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from app.engine.errors import InvalidRequestError
from app.engine.guided import Guide
from app.engine.sampling_params import SamplingParams
from app.protocol.messages import GenerationJob, TextChunk


# OpenAI fields this server does not implement, with the one value of each that asks for nothing
# (clients often send it): accepted. Any other value, and any field not named anywhere, is refused
# by name: a client asking for JSON must not get a 200 with free text.
NEUTRAL = {"logit_bias": {}, "tools": [], "tool_choice": "none",
           "best_of": 1, "top_logprobs": 0, "suffix": ""}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # the last streamed chunk carries usage either way


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None  # the output always matches the schema, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    user: str | None = Field(None, max_length=256, description="labels the end user; changes nothing generated")
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1)  # the engine caps it (max_return_sequences)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    # vLLM's guided decoding extras
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart]  # text parts are joined; other parts (images, audio) are refused

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"only text parts are supported, not {str(kind)[:40]!r}")
        return content

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False


def _validate(cls, body: Any):
    if isinstance(body, dict):
        for key, value in body.items():
            if key not in cls.model_fields and value is not None and (key not in NEUTRAL or NEUTRAL[key] != value):
                raise InvalidRequestError(key, "is not supported by this server" + (
                    f" (only its neutral value {NEUTRAL[key]!r})" if key in NEUTRAL else ""))
        body = {k: v for k, v in body.items() if k in cls.model_fields}
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise InvalidRequestError(".".join(str(p) for p in err["loc"]) or "body",
                                  err["msg"].removeprefix("Value error, ")) from None


def _guide(req: _Request) -> Guide | None:
    """At most one guide: response_format (json_object, json_schema) or one of vLLM's guided_*."""
    guides = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        guides.append(Guide("json", "", "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidRequestError("response_format.json_schema", "is required for type json_schema")
        guides.append(Guide("json_schema", json.dumps(fmt.json_schema.json_schema), "response_format.json_schema"))
    if req.guided_json is not None:
        spec = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
        guides.append(Guide("json_schema", spec, "guided_json"))
    if req.guided_regex is not None:
        guides.append(Guide("regex", req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        guides.append(Guide("regex", "|".join(_regex_literal(c) for c in req.guided_choice), "guided_choice"))
    if req.guided_grammar is not None:
        guides.append(Guide("ebnf", req.guided_grammar, "guided_grammar"))
    if len(guides) > 1:
        raise InvalidRequestError(guides[1].field, f"only one guide per request ({guides[0].field} is set too)")
    return guides[0] if guides else None


def _regex_literal(text: str) -> str:
    """`text` matched literally: its regex metacharacters escaped."""
    return "(" + "".join("\\" + c if c in r"\.^$*+?{}[]|()" else c for c in text) + ")"


def _job(req: _Request, max_tokens_default: int, logprobs: bool, **prompt) -> GenerationJob:
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    params = SamplingParams(
        max_tokens=req.max_completion_tokens or req.max_tokens or max_tokens_default, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, n=req.n, seed=req.seed,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
        logprobs=logprobs, guide=_guide(req))
    return GenerationJob(request_id=f"cmpl-{uuid.uuid4().hex}", params=params, stop=stop, api="openai", **prompt)


def parse_completion(body: Any, max_tokens_default: int) -> tuple[GenerationJob, CompletionRequest]:
    req = _validate(CompletionRequest, body)
    if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str):
        if len(req.prompt) != 1:
            raise InvalidRequestError("prompt", "takes one prompt per request")
        req.prompt = req.prompt[0]
    prompt = {"prompt_token_ids": req.prompt} if isinstance(req.prompt, list) else {"prompt": req.prompt}
    return _job(req, max_tokens_default, req.logprobs is not None, **prompt), req


def parse_chat(body: Any, max_tokens_default: int) -> tuple[GenerationJob, ChatRequest]:
    req = _validate(ChatRequest, body)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    return _job(req, max_tokens_default, req.logprobs, messages=messages), req


def models_list(names: list[str]) -> dict:
    return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "llm-serve"}
                                       for n in names]}


def _usage(chunk: TextChunk, completion_tokens: int) -> dict:
    return {"prompt_tokens": chunk.num_prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": chunk.num_prompt_tokens + completion_tokens}


def completion_response(job_id: str, model: str, chunk: TextChunk, chat: bool, stream: bool,
                        echo_text: str = "") -> dict:
    """A whole response (stream=False) or one SSE chunk (stream=True) in OpenAI's shape."""
    choices = []
    for o in chunk.outputs:
        finish = o.finish_reason if o.finish_reason != "abort" else None
        if chat:
            body = {"delta" if stream else "message": ({"role": "assistant", "content": o.text})}
            choice = {"index": o.index, **body, "finish_reason": finish}
            if o.logprobs is not None:
                choice["logprobs"] = {"content": [{"token": str(t), "logprob": lp, "bytes": None, "top_logprobs": []}
                                                  for t, lp in zip(o.token_ids, o.logprobs)]}
        else:
            choice = {"index": o.index, "text": echo_text + o.text, "finish_reason": finish,
                      "logprobs": {"tokens": [str(t) for t in o.token_ids], "token_logprobs": o.logprobs}
                      if o.logprobs is not None else None}
        choices.append(choice)
    obj = "chat.completion" if chat else "text_completion"
    out = {"id": job_id, "object": obj + (".chunk" if stream and chat else ""), "created": int(time.time()),
           "model": model, "choices": choices}
    if not stream or chunk.finished:
        generated = chunk.metrics.num_output_tokens if chunk.metrics else sum(len(o.token_ids) for o in chunk.outputs)
        out["usage"] = _usage(chunk, generated)
    return out


def error_body(exc: InvalidRequestError | str, status: int = 400, param: str | None = None) -> dict:
    # From the fields: an error that crossed Ray hops prints as the whole remote traceback.
    message = f"{exc.field}: {exc.message}" if isinstance(exc, InvalidRequestError) else str(exc)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": getattr(exc, "field", param), "code": status}}
