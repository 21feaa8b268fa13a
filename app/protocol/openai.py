"""OpenAI-compatible /v1 shapes: models, completions, chat completions (streaming and not)."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from app.engine.errors import InvalidRequestError
from app.engine.guided import Guide
from app.engine.sampling_params import SamplingParams
from app.protocol import tools
from app.protocol.body import TOKEN_ID_LIMIT, TokenId, parse_body
from app.protocol.messages import GenerationJob, PromptText, TextChunk, TextOutput


# OpenAI fields a route does not implement (tools on /v1/completions), with the one value of each
# that asks for nothing (clients often send it): accepted. Any other value, and any field not named
# anywhere, is refused by name: a client asking for JSON must not get a 200 with free text.
NEUTRAL = {"tools": [], "tool_choice": "none", "best_of": 1, "suffix": "", "echo": False}


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
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural tag: [{"begin", "schema", "end"}] and triggers; the guide checks their shape
    structures: list | None = None
    triggers: list | None = None


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
    logit_bias: dict[int, float] | None = None  # token id (a string in JSON) -> bias; the engine checks the range
    # vLLM's guided decoding extras
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None


class CompletionRequest(_Request):
    prompt: str | list[TokenId] | list[str]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt alone (vLLM's extension)
    logprobs: int | None = Field(None, ge=0, le=5)  # the likeliest tokens per position, beside the chosen one
    echo: bool = False  # the prompt before the completion, and with logprobs its tokens' logprobs too
    best_of: int | None = Field(None, ge=1)  # generated server-side; the n likeliest are returned

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids(cls, v):
        """A list that is not of strings is of token ids: said so by position (the union's own
        error named its first member: "prompt.str: Input should be a valid string")."""
        if isinstance(v, list) and v and not isinstance(v[0], str):
            for i, t in enumerate(v):
                if type(t) is not int or not 0 <= t < TOKEN_ID_LIMIT:
                    raise ValueError(f"token ids are integers in [0, 2**31); item {i} is {t!r}")
        return v

    @property
    def prompt_only(self) -> bool:
        return self.max_tokens == 0


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text of an object


class ToolCall(BaseModel):
    """A call of an earlier assistant turn, as the client sends it back."""
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer: OpenAI's newer system
    # Text parts are joined; other parts (images, audio) are refused. Null only beside tool_calls.
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=64)  # the participant's name, for templates that show it
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: None = None  # an earlier answer's refusal: clients send back null (a text is not supported)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"only text parts are supported, not {str(kind)[:40]!r}")
        return content

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content or ())


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # arguments match `parameters` under tool_choice required or named, strict or not

    @field_validator("parameters")
    @classmethod
    def _object(cls, schema: dict) -> dict:
        if schema.get("type", "object") != "object":
            raise ValueError("must be a JSON schema of type object (a function's arguments are an object)")
        return {"type": "object", **schema}  # {} (anything) would let a forced call's arguments be any JSON


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool = True  # false: at most one call (the grammar's, or the first one parsed)

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _one_message(cls, value, handler):
        try:  # one sentence instead of an error per member of the union
            return handler(value)
        except ValidationError:
            raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}') \
                from None

    @property
    def forced_function(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def forces_call(self) -> bool:
        return self.tool_choice == "required" or self.forced_function is not None

    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def tool_guide(self) -> Guide | None:
        """Under tool_choice required or a named function: the output's JSON (tools.Forced)."""
        if not (self.calls_tools() and self.forces_call):
            return None
        functions = {t.function.name: t.function.parameters for t in self.tools}
        return Guide("json_schema", json.dumps(tools.Forced.schema(functions, self.forced_function,
                                                                   self.parallel_tool_calls)), "tool_choice")


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
        # "[key]" is pydantic's mark for a dict key that failed: logit_bias.abc, not logit_bias.abc.[key]
        raise InvalidRequestError(".".join(str(p) for p in err["loc"] if p != "[key]") or "body",
                                  err["msg"].removeprefix("Value error, ")) from None


def _guide(req: _Request) -> Guide | None:
    """At most one guide: response_format (json_object, json_schema, structural_tag) or one of
    vLLM's guided_*."""
    guides = []
    fmt = req.response_format
    for name, owner in (("json_schema", "json_schema"), ("structures", "structural_tag"), ("triggers", "structural_tag")):
        if fmt is not None and getattr(fmt, name) is not None and fmt.type != owner:  # never silently ignored
            raise InvalidRequestError(f"response_format.{name}", f"belongs to type {owner}, not {fmt.type}")
    if fmt is not None and fmt.type == "json_object":
        guides.append(Guide("json", "", "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidRequestError("response_format.json_schema", "is required for type json_schema")
        guides.append(Guide("json_schema", json.dumps(fmt.json_schema.json_schema), "response_format.json_schema"))
    elif fmt is not None and fmt.type == "structural_tag":
        spec = {"structures": fmt.structures, "triggers": fmt.triggers}
        guides.append(Guide("structural_tag", json.dumps({k: v for k, v in spec.items() if v is not None}),
                            "response_format"))
    if req.guided_json is not None:
        spec = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
        guides.append(Guide("json_schema", spec, "guided_json"))
    if req.guided_regex is not None:
        guides.append(Guide("regex", req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        guides.append(Guide("regex", "|".join(_regex_literal(c) for c in req.guided_choice), "guided_choice"))
    if req.guided_grammar is not None:
        guides.append(Guide("ebnf", req.guided_grammar, "guided_grammar"))
    if isinstance(req, ChatRequest) and (tool_guide := req.tool_guide()) is not None:
        guides.append(tool_guide)
    if len(guides) > 1:
        raise InvalidRequestError(guides[1].field, f"only one guide per request ({guides[0].field} is set too)")
    return guides[0] if guides else None


def _regex_literal(text: str) -> str:
    """`text` matched literally: its regex metacharacters escaped."""
    return "(" + "".join("\\" + c if c in r"\.^$*+?{}[]|()" else c for c in text) + ")"


def _job(req: _Request, max_tokens_default: int | None, logprobs: bool, top_logprobs: int, **prompt) -> GenerationJob:
    if req.max_tokens is not None and req.max_completion_tokens not in (None, req.max_tokens):
        raise InvalidRequestError("max_completion_tokens", f"and max_tokens ({req.max_tokens}) disagree; "
                                                           "send one (max_tokens is its older name)")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options", "is only allowed with stream: true")
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    params = SamplingParams(
        max_tokens=req.max_completion_tokens or req.max_tokens or max_tokens_default, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, n=req.n, seed=req.seed,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
        logprobs=logprobs, top_logprobs=top_logprobs, logit_bias=req.logit_bias or {}, guide=_guide(req))
    return GenerationJob(request_id=f"cmpl-{uuid.uuid4().hex}", params=params, stop=stop, api="openai", **prompt)


def parse_completion(body: Any, max_tokens_default: int | None,
                     max_return_sequences: int | None = None) -> tuple[GenerationJob, CompletionRequest]:
    """`max_return_sequences` caps best_of (the engine caps n, which best_of becomes)."""
    req = _validate(CompletionRequest, body)
    if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str):
        if len(req.prompt) != 1:
            raise InvalidRequestError("prompt", "takes one prompt per request")
        req.prompt = req.prompt[0]
    if req.prompt_only and not req.echo:
        raise InvalidRequestError("max_tokens", "may be 0 only with echo: true (the prompt alone)")
    best_of = req.best_of or req.n
    if best_of < req.n:
        raise InvalidRequestError("best_of", f"must be at least n ({req.n})")
    if best_of > req.n and req.stream:
        raise InvalidRequestError("best_of", "does not combine with stream: true (the likeliest are known at the end)")
    if max_return_sequences is not None and best_of > max_return_sequences:
        raise InvalidRequestError("best_of", f"{best_of} exceeds this server's max_return_sequences of "
                                             f"{max_return_sequences}")
    prompt = {"prompt_token_ids": req.prompt} if isinstance(req.prompt, list) else {"prompt": req.prompt}
    job = _job(req, max_tokens_default, req.logprobs is not None, req.logprobs or 0, **prompt)
    # max_tokens 0 generates one token that the answer leaves out (as vLLM does): the prompt's logits
    # come from the step that computes its last token, which samples.
    job.params = replace(job.params, n=best_of, max_tokens=1 if req.prompt_only else job.params.max_tokens,
                         prompt_logprobs=req.logprobs if req.echo else None)
    job.echo = req.echo
    return job, req


def parse_chat(body: Any, max_tokens_default: int | None) -> tuple[GenerationJob, ChatRequest]:
    req = _validate(ChatRequest, body)
    names = [t.function.name for t in req.tools or ()]
    if len(set(names)) < len(names):
        raise InvalidRequestError("tools", "names a function twice")
    if req.forces_call:
        if not names:
            raise InvalidRequestError("tool_choice", "asks for a tool call but the request has no tools")
        if req.forced_function not in (None, *names):
            raise InvalidRequestError("tool_choice.function.name", f"is not one of the tools ({', '.join(names)})")
    # tool_choice none: the tools stay out of the prompt too, so that the model is not asked to
    # write calls that would come back as raw text.
    functions = [t.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for t in req.tools] \
        if req.calls_tools() else None
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequestError("top_logprobs", "requires logprobs: true")
    job = _job(req, max_tokens_default, req.logprobs, req.top_logprobs or 0, messages=_template_messages(req.messages),
               tools=functions)
    return job, req


def _template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as chat templates take them (transformers' convention): a call's arguments as an
    object, a tool result with the name of the function it answers (Hermes templates print it)."""
    out, called = [], {}
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if m.content is None and not m.tool_calls:
            raise InvalidRequestError(f"{where}.content", "is required (null only beside tool_calls)")
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequestError(f"{where}.tool_calls", "belong to assistant messages")
        if (m.tool_call_id is None) == (m.role == "tool"):
            raise InvalidRequestError(f"{where}.tool_call_id", "is required on tool messages, and only there")
        # "" for null content: templates concatenate it
        message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        for j, call in enumerate(m.tool_calls or ()):
            field = f"{where}.tool_calls.{j}.function.arguments"
            try:
                arguments = parse_body(call.function.arguments.encode())
            except InvalidRequestError as exc:
                raise InvalidRequestError(field, exc.message) from None
            if not isinstance(arguments, dict):
                raise InvalidRequestError(field, "must be a JSON object")
            message.setdefault("tool_calls", []).append(
                {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}})
            called[call.id] = call.function.name
        if m.role == "tool":
            if m.tool_call_id not in called:
                raise InvalidRequestError(f"{where}.tool_call_id", "answers no tool call of an earlier message")
            message.update(tool_call_id=m.tool_call_id, name=called[m.tool_call_id])
        out.append(message)
    return out


def tool_calls(req: ChatRequest, parser: str) -> tools.ToolCallStream | None:
    """What finds the calls in a response's text: the forced JSON, or the model's format (`parser`)."""
    if not req.calls_tools():
        return None
    fmt = tools.Forced(req.forced_function) if req.forces_call else tools.PARSERS[parser]
    return tools.ToolCallStream(fmt, [t.function.name for t in req.tools], req.parallel_tool_calls)


def models_list(names: list[str]) -> dict:
    return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "llm-serve"}
                                       for n in names]}


def _usage(chunk: TextChunk, completion_tokens: int) -> dict:
    return {"prompt_tokens": chunk.num_prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": chunk.num_prompt_tokens + completion_tokens}


class CompletionChoices:
    """A /v1/completions answer's choices from the engine's outputs (one per response, fed its
    chunks in order): of best_of outputs the n likeliest (highest cumulative logprob), numbered
    0..n-1; with echo the prompt before each choice's first text and its logprobs before the
    first token's; under max_tokens 0 nothing generated, the prompt alone."""

    def __init__(self, req: CompletionRequest):
        self.n, self.best_of = req.n, req.best_of or req.n
        self.echo, self.prompt_only = req.echo, req.prompt_only
        self.prompt: PromptText | None = None  # the first chunk's
        self.echoed: set[int] = set()

    def __call__(self, chunk: TextChunk) -> TextChunk:
        self.prompt = self.prompt or chunk.prompt
        outputs = chunk.outputs
        if self.best_of > self.n:  # never streamed: these are the whole outputs
            best = sorted(outputs, key=lambda o: o.cumulative_logprob, reverse=True)[:self.n]
            outputs = [replace(o, index=i) for i, o in enumerate(best)]
        metrics = chunk.metrics
        if self.prompt_only:  # the one token generated to reach the prompt's end is not shown
            outputs = [replace(o, text="", token_ids=[], logprobs=None if o.logprobs is None else [],
                               tokens=None if o.tokens is None else [],
                               finish_reason="length" if o.finish_reason in ("stop", "length") else o.finish_reason)
                       for o in outputs]
            metrics = metrics and replace(metrics, num_output_tokens=0)
        if self.echo:
            outputs = [self._echoed(o) for o in outputs]
        return replace(chunk, outputs=outputs, metrics=metrics)

    def _echoed(self, o: TextOutput) -> TextOutput:
        """The output with the prompt in front: its text once per choice, its logprobs when asked,
        and text offsets counted from the prompt's start."""
        shift = len(self.prompt.text)
        tokens = None if o.tokens is None else [replace(t, offset=t.offset + shift) for t in o.tokens]
        o = replace(o, tokens=tokens)
        if o.index in self.echoed:
            return o
        self.echoed.add(o.index)
        if o.logprobs is None or self.prompt.logprobs is None:
            return replace(o, text=self.prompt.text + o.text)
        return replace(o, text=self.prompt.text + o.text, logprobs=self.prompt.logprobs + o.logprobs,
                       tokens=self.prompt.tokens + o.tokens)


class StreamState:
    """What a streamed response keeps between its chunks, as OpenAI's: one `created`, a choice's role
    in its first delta only, and the usage of the whole stream, sent after the last chunk in one of
    its own (no choices) where stream_options.include_usage asks, and not at all otherwise."""

    def __init__(self, req: _Request, job_id: str, model: str, chat: bool):
        self.header = {"id": job_id, "object": "chat.completion.chunk" if chat else "text_completion",
                       "created": int(time.time()), "model": model}
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.started: set[int] = set()  # choices whose first delta went out
        self.generated = 0  # tokens of every chunk so far
        self.usage: dict | None = None

    def usage_chunk(self) -> dict | None:
        return {**self.header, "choices": [], "usage": self.usage} if self.include_usage else None


def completion_response(job_id: str, model: str, chunk: TextChunk, chat: bool, stream: StreamState | None = None,
                        calls: tools.ToolCallStream | None = None, completion: CompletionChoices | None = None) -> dict:
    """A whole response, or with `stream` (one per response) one SSE chunk, in OpenAI's shape;
    `calls` (one per response) turns a chat output's tool calls into message.tool_calls,
    `completion` (one per response) makes a completion's choices of the engine's outputs."""
    if completion is not None:
        chunk = completion(chunk)
    choices = []
    for o in chunk.outputs:
        finish = o.finish_reason if o.finish_reason != "abort" else None
        if chat:
            message = {"content": o.text}
            if stream is None or o.index not in stream.started:
                message = {"role": "assistant", **message}
            if calls is not None:
                message["content"], found = calls.push(o.index, o.text, chunk.finished or o.finish_reason is not None,
                                                       truncated=o.finish_reason == "length")
                if found:
                    message["content"] = message["content"].strip() or None
                    message["tool_calls"] = [{"index": k, **c} for k, c in enumerate(found)] if stream else found
                    finish = "tool_calls"
            choice = {"index": o.index, "delta" if stream else "message": message, "finish_reason": finish}
            if stream is not None:
                stream.started.add(o.index)
            if o.logprobs is not None:
                choice["logprobs"] = {"content": [
                    {**_token(t.text, t.bytes, lp), "top_logprobs": [_token(*alt) for alt in t.top]}
                    for t, lp in zip(o.tokens, o.logprobs)]}
        else:
            choice = {"index": o.index, "text": o.text, "finish_reason": finish,
                      "logprobs": _completion_logprobs(o) if o.logprobs is not None else None}
        choices.append(choice)
    if stream is None:
        generated = chunk.metrics.num_output_tokens if chunk.metrics else sum(len(o.token_ids) for o in chunk.outputs)
        return {"id": job_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model, "choices": choices, "usage": _usage(chunk, generated)}
    stream.generated += sum(len(o.token_ids) for o in chunk.outputs)
    if chunk.finished:  # without the engine's count (a stop string ended it here): what the chunks carried
        stream.usage = _usage(chunk, chunk.metrics.num_output_tokens if chunk.metrics else stream.generated)
    return {**stream.header, "choices": choices, **({"usage": None} if stream.include_usage else {})}


def _token(text: str, raw: bytes, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


def _completion_logprobs(o: TextOutput) -> dict:
    """The legacy shape: per position a {text: logprob} of the likeliest tokens plus the chosen one
    (so up to logprobs + 1 entries, as OpenAI says); tokens with the same text share an entry. An
    echoed prompt's first token has no logprob: null, and null alternatives."""
    top = []
    for t, lp in zip(o.tokens, o.logprobs):
        entry: dict[str, float] = {}
        for text, _, value in [*t.top, (t.text, b"", lp)]:
            entry.setdefault(text, value)  # best first; the likelier of two same texts
        top.append(None if lp is None else entry)
    return {"tokens": [t.text for t in o.tokens], "token_logprobs": o.logprobs, "top_logprobs": top,
            "text_offset": [t.offset for t in o.tokens]}


def error_body(exc: InvalidRequestError | str, status: int = 400, param: str | None = None) -> dict:
    # From the fields: an error that crossed Ray hops prints as the whole remote traceback.
    message = f"{exc.field}: {exc.message}" if isinstance(exc, InvalidRequestError) else str(exc)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": getattr(exc, "field", param), "code": status}}
