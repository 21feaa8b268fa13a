"""The HTTP front: Triton generate + KServe v2 routes and OpenAI routes over the DAG.

Requests are validated here (pydantic) and refused with 400 naming the field before any stage
is called; an error after a stream started ends it with an error event.
"""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from app.adapters import AdapterPolicy
from app.batching import Coalescer
from app.channel import Inbound
from app.config import ServiceConfig
from app.engine.errors import BackendError, EngineDeadError, EngineStepError, InvalidRequestError
from app.engine.outputs import FinishReason
from app.protocol import openai, openapi, triton, triton_binary
from app.protocol.body import parse_body
from app.protocol.messages import (AdapterRef, GenerationJob, TextChunk, TextOutput, check_job, merge_chunks,
                                   tokenized_as_sent)
from app.security import api_key, refusal
from deployments.handles import for_this_replica
from deployments.metrics import IngressMetrics

logger = logging.getLogger("ray.serve")
READY_TIMEOUT_S = 2.0
api = FastAPI(title="llm-serve")
api.state.api_key, api.state.max_request_bytes = None, 1 << 20  # the replica sets the config's


def _behind(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The `kind` error behind an exception that crossed Ray hops, if there is one. Ray's wrapper
    of a remote `kind` error is an instance of `kind` too, but prints the whole remote traceback:
    the error it wraps (its `cause`) is the one returned."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, kind) and not isinstance(exc, RayTaskError):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None


def request_error(exc: BaseException) -> InvalidRequestError | None:
    return _behind(exc, InvalidRequestError)


def _status(exc: BaseException) -> tuple[int, str]:
    # From their fields: an error that crossed Ray hops prints as the whole remote traceback.
    bad = request_error(exc)
    if bad is not None:
        return bad.status, f"{bad.field}: {bad.message}"
    failed = _behind(exc, BackendError)
    if failed is not None:
        return failed.status, f"{failed.backend}: {failed.message}"
    if isinstance(exc, BackPressureError):
        return 503, "server is at capacity; retry later"
    if _behind(exc, RayActorError) is not None:
        return 503, "a replica serving this request died; it is being replaced, retry"
    step = _behind(exc, EngineStepError)
    if step is not None:
        return 500, str(step)
    if _behind(exc, EngineDeadError) is not None:
        return 503, "the engine of the replica serving this request stopped; it is being replaced, retry"
    # The message must not leak internals (paths, tracebacks): the log has them, under this id.
    incident = uuid.uuid4().hex[:16]
    logger.error("request failed: incident %s", incident, exc_info=exc)
    return 500, f"internal error ({type(exc).__name__}); the server log holds its details under incident {incident}"


def _stopped(last: dict[int, TextOutput], num_prompt_tokens: int) -> TextChunk:
    """The last chunk of a request that a stop request ended: its unfinished outputs end, with no
    new text, as the engine ends an aborted request."""
    ended = [TextOutput(i, "", [], None, o.cumulative_logprob, FinishReason.ABORT.value)
             for i, o in sorted(last.items()) if o.finish_reason is None]
    return TextChunk(ended or [TextOutput(0, "", [], None, 0.0, FinishReason.ABORT.value)], True, num_prompt_tokens)


def _sse(obj) -> bytes:  # obj: a response, or one rendered already (triton.to_json)
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj, ensure_ascii=False).encode()) + b"\n\n"


async def _json_off_loop(obj: dict) -> Response:
    """A response carrying logits, rendered on a thread: the event loop serves others meanwhile."""
    return Response(await asyncio.to_thread(triton.to_json, obj), media_type="application/json")


class Guard:
    """API key and body size, before any route runs. A plain ASGI middleware: Starlette's
    `@app.middleware("http")` copies every chunk of a streamed response through an extra task and
    memory stream, a cost per SSE event on the hottest path. The settings are on the app's state,
    set by the replica: Serve runs its own copy of `api`, not this module's object."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state, path, root = scope["app"].state, scope["path"], scope.get("root_path", "")
        path = path[len(root):] if root and path.startswith(root) else path  # the route prefix of the app
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        refused = refusal(path, headers, state.api_key, state.max_request_bytes)
        if refused is None:
            return await self.app(scope, receive, send)
        status, message = refused
        field = message.split(":")[0]
        body = openai.error_body(InvalidRequestError(field, message.split(": ", 1)[1], status), status) \
            if path.startswith("/v1/") else {"error": message}
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)


api.add_middleware(Guard)


@serve.deployment(name="Ingress")
@serve.ingress(api)
class Ingress:
    def __init__(self, config: ServiceConfig, tokenizer: DeploymentHandle, detokenizer: DeploymentHandle,
                 engine: DeploymentHandle, request_ids: DeploymentHandle):
        self.config = config
        self.name = config.name
        self.tokenizer = for_this_replica(tokenizer)
        # A wave of arrivals is tokenized in few calls, not one each (app/batching.py).
        self.tokenize = Coalescer(lambda jobs: self.tokenizer.tokenize_many.remote(jobs))
        self.detokenizer = for_this_replica(detokenizer)
        self.engine = for_this_replica(engine)
        self.adapters = AdapterPolicy(config.lora_roots, config.lora_adapters)
        self.metrics = IngressMetrics(config.name)
        self.inbound = Inbound(ray.util.get_node_ip_address(), merge_chunks)  # from the Detokenizers
        self.tool_parser: str | None = None  # the Tokenizer's (it reads the chat template), asked once
        self.request_ids = request_ids  # the app's registry of client-chosen ids (deployments/request_ids.py)
        self.owner = uuid.uuid4().hex  # this replica, to the registry
        self.stops: dict[str, asyncio.Event] = {}  # ids this replica streams -> set by a stop request
        self.polling: asyncio.Task | None = None
        api.state.api_key = api_key(config.api_key)
        api.state.max_request_bytes = config.max_request_bytes

    async def _body(self, request: Request) -> bytes:
        """The body, at most max_request_bytes even when sent without a Content-Length."""
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > self.config.max_request_bytes:
                raise InvalidRequestError("body", f"exceeds the limit of {self.config.max_request_bytes} bytes",
                                          status=413)
        return bytes(body)

    async def _json(self, request: Request):
        return parse_body(await self._body(request))

    # -- the DAG -----------------------------------------------------------------------------------
    async def _chunks(self, job: GenerationJob,
                      client_id: str | None = None) -> AsyncIterator[tuple[TextChunk, list[int]]]:
        """The request's chunks; a stop request naming `client_id`, the id the client chose, may end them."""
        check_job(job, self.config.max_stop_words, self.config.max_stop_word_len)
        if job.adapter is not None:
            job.adapter = self.adapters.resolve(job.adapter)  # refuses paths outside the roots, unopened
        started, first, finished, num_output = time.monotonic(), None, False, 0
        last: dict[int, TextOutput] = {}
        async with self._claimed(client_id) as stop:
            tokenized = tokenized_as_sent(job) or await self.tokenize(job)
            try:
                async with aclosing(self.inbound.receive(
                        lambda reply_to: self.detokenizer.generate.remote(tokenized, reply_to), stop)) as chunks:
                    async for chunk in chunks:
                        first = first or time.monotonic()
                        num_output += sum(len(o.token_ids) for o in chunk.outputs)
                        last.update((o.index, o) for o in chunk.outputs)
                        finished = chunk.finished
                        yield chunk, tokenized.prompt_token_ids
                if not finished:  # stopped by id; leaving cancelled the call upstream, which frees the KV
                    finished = True
                    yield _stopped(last, len(tokenized.prompt_token_ids)), tokenized.prompt_token_ids
            finally:
                if finished:
                    self.metrics.succeeded(job.api, started, first, len(tokenized.prompt_token_ids), num_output)

    @asynccontextmanager
    async def _claimed(self, request_id: str | None):
        """While a request whose id the client chose is in flight, the id is claimed app-wide (409
        for a second request under it) and a stop request for it, on any Ingress replica, sets the
        event yielded. Ids we make up are never claimed: no client can name them."""
        if request_id is None:
            yield None
            return
        if request_id in self.stops:  # in flight here: the registry may have forgotten it (restarted)
            raise InvalidRequestError("request_id", f"'{request_id}' is already in flight; a request id must be "
                                                    "unique among the requests in flight", status=409)
        # Taken here before the claim: a stop the registry hands back before the claim's answer finds it.
        stop = self.stops[request_id] = asyncio.Event()
        claim = asyncio.ensure_future(self._claim(request_id))
        try:
            await asyncio.shield(claim)
            if self.polling is None or self.polling.done():
                self.polling = asyncio.create_task(self._poll_stops())
            yield stop
        finally:
            del self.stops[request_id]
            # A caller cancelled during the claim releases once the claim has landed, never before it
            # (two calls to the registry keep no order). It ignores releases of ids others own.
            claim.add_done_callback(lambda done: self._release(request_id, done))

    async def _claim(self, request_id: str) -> None:
        await self.request_ids.claim.remote(request_id, self.owner)

    def _release(self, request_id: str, claim: asyncio.Future) -> None:
        if not claim.cancelled():
            claim.exception()  # fetched: a claim whose caller left is nobody's to raise
        self.request_ids.release.remote(request_id, self.owner)  # nothing to wait for

    async def _poll_stops(self) -> None:
        """One long poll at a time, while this replica streams named requests: the registry answers
        with the ids stopped (by a stop request on any replica), or with none every POLL_S, which
        also tells it this replica is alive."""
        while self.stops:
            try:
                stopped = await self.request_ids.take.remote(self.owner)
            except Exception:  # noqa: BLE001 - the registry is being replaced: its stops resume after
                logger.warning("the request id registry did not answer; polling again", exc_info=True)
                await asyncio.sleep(1.0)
                continue
            for request_id in stopped:
                if request_id in self.stops:
                    self.stops[request_id].set()

    async def _whole(self, job: GenerationJob, client_id: str | None = None) -> tuple[TextChunk, list[int]]:
        merged, ids = None, []
        async for chunk, ids in self._chunks(job, client_id):
            merged = chunk if merged is None else merge_chunks(merged, chunk)
        return merged, ids

    def _error(self, exc: BaseException, openai_style: bool) -> JSONResponse:
        status, message = _status(exc)
        self.metrics.failed("openai" if openai_style else "triton", status)
        headers = {"Retry-After": "1"} if status == 503 else None
        body = openai.error_body(request_error(exc) or message, status) if openai_style else {"error": message}
        return JSONResponse(body, status_code=status, headers=headers)

    async def _stream(self, job: GenerationJob, render, openai_style: bool, done_marker: bool = False,
                      client_id: str | None = None, threaded: bool = False, trailer=lambda: None):
        """First chunk awaited before answering, so early errors are proper 4xx responses. `threaded`:
        chunks are rendered on a thread (large ones: logits). `trailer()`: an event after the last
        chunk, if any (OpenAI's usage)."""
        chunks = self._chunks(job, client_id)
        try:
            first = await anext(chunks)
        except Exception as exc:  # noqa: BLE001
            await chunks.aclose()
            return self._error(exc, openai_style)
        except BaseException:
            await chunks.aclose()
            raise

        async def events():
            try:
                yield _sse(await asyncio.to_thread(render, *first) if threaded else render(*first))
                async for chunk, ids in chunks:
                    yield _sse(await asyncio.to_thread(render, chunk, ids) if threaded else render(chunk, ids))
                if (last := trailer()) is not None:
                    yield _sse(last)
                if done_marker:
                    yield b"data: [DONE]\n\n"
            except Exception as exc:  # noqa: BLE001 - the status is sent: report in the stream
                status, message = _status(exc)
                self.metrics.failed(job.api, status)
                yield _sse(openai.error_body(message, status) if openai_style else {"error": message})
            finally:
                await chunks.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    # -- Triton / KServe v2 ------------------------------------------------------------------------
    @api.get("/v2/health/live")
    async def live(self):
        return Response(status_code=200)

    @api.get("/v2/health/ready")
    async def ready(self):
        """Ready when every stage answers within a couple of seconds and the engine is healthy (not
        while the model loads or a dead replica of any stage is being replaced)."""
        checks = (self.engine.stats.remote(), self.tokenizer.ready.remote(), self.detokenizer.ready.remote())
        try:
            stats, *_ = await asyncio.wait_for(asyncio.gather(*checks), timeout=READY_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - no answer in time is not ready
            return Response(status_code=503)
        return Response(status_code=200 if stats["healthy"] else 503)

    @api.get("/v2")
    async def server_metadata(self):
        return {"name": "llm-serve", "version": "0.1.0",
                "extensions": ["generate", "generate_stream", "binary_tensor_data"]}

    def _models(self) -> tuple[str, ...]:
        return (self.name, *triton.TEXT_MODELS, triton.IDS_MODEL)

    @api.get("/v2/models/{model}")
    @api.get("/v2/models/{model}/versions/{version}")
    async def model_metadata(self, model: str, version: str = triton.MODEL_VERSION):
        if model not in self._models():
            return JSONResponse({"error": f"unknown model '{model}'"}, status_code=404)
        inputs = [{"name": "text_input", "datatype": "BYTES", "shape": [-1]},
                  {"name": "max_tokens", "datatype": "INT32", "shape": [-1]}]
        if model == triton.IDS_MODEL:
            inputs.append({"name": "input_ids", "datatype": "INT32", "shape": [-1, -1]})
        return {"name": model, "versions": [triton.MODEL_VERSION], "platform": "ensemble" if model != triton.IDS_MODEL
                else "tensorrt_llm", "inputs": inputs,
                "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]}

    @api.get("/v2/models/{model}/ready")
    @api.get("/v2/models/{model}/versions/{version}/ready")
    async def model_ready(self, model: str, version: str = triton.MODEL_VERSION):
        if model not in self._models():
            return JSONResponse({"error": f"unknown model '{model}'"}, status_code=404)
        return await self.ready()

    async def _parse_triton(self, model: str, request: Request, streams: bool):
        """(job, request) of a generate body, or None for a stop request, which is carried out here."""
        body = await self._json(request)
        if await self._stop(model, body):
            return None
        return triton.parse_generate(model, body, self.name, self.config.max_tokens_default, streams)

    async def _stop(self, model: str, fields) -> bool:
        """Carry out a stop request (`stop: true`, Triton's cancellation by request id): the replica
        streaming that id ends it, wherever it runs; 404 naming request_id when none is in flight.
        False when `fields` are not a stop request."""
        request_id = triton.parse_stop(model, fields, self.name)
        if request_id is None:
            return False
        await self.request_ids.stop.remote(request_id)
        return True

    @api.post("/v2/models/{model}/generate", openapi_extra=openapi.body(triton.TritonGenerateRequest))
    @api.post("/v2/models/{model}/versions/{version}/generate",
              openapi_extra=openapi.body(triton.TritonGenerateRequest))
    async def generate(self, model: str, request: Request, version: str = triton.MODEL_VERSION):
        try:
            parsed = await self._parse_triton(model, request, streams=False)
            if parsed is None:
                return triton.stop_response(model)
            job, req = parsed
            chunk, ids = await self._whole(job, req.request_id or None)
        except Exception as exc:  # noqa: BLE001
            return self._error(exc, openai_style=False)
        prompt_text = job.prompt or ""
        out = triton.generate_response(model, req, chunk, prompt_text, ids, final=True)
        return await _json_off_loop(out) if triton.returns_logits(req) else out

    @api.post("/v2/models/{model}/generate_stream", openapi_extra=openapi.body(triton.TritonGenerateRequest))
    @api.post("/v2/models/{model}/versions/{version}/generate_stream",
              openapi_extra=openapi.body(triton.TritonGenerateRequest))
    async def generate_stream(self, model: str, request: Request, version: str = triton.MODEL_VERSION):
        try:
            parsed = await self._parse_triton(model, request, streams=True)
        except Exception as exc:  # noqa: BLE001
            return self._error(exc, openai_style=False)
        if parsed is None:
            return StreamingResponse(iter([_sse(triton.stop_response(model))]), media_type="text/event-stream")
        job, req = parsed
        logits = triton.returns_logits(req)
        if req.stream is False:  # TensorRT-LLM's non-streaming mode: the whole answer, one event
            try:
                chunk, ids = await self._whole(job, req.request_id or None)
            except Exception as exc:  # noqa: BLE001
                return self._error(exc, openai_style=False)
            out = triton.generate_response(model, req, chunk, job.prompt or "", ids, final=True)
            event = _sse(await asyncio.to_thread(triton.to_json, out) if logits else out)
            return StreamingResponse(iter([event]), media_type="text/event-stream")

        def render(chunk, ids):
            out = triton.generate_response(model, req, chunk, "", ids, final=chunk.finished)
            return triton.to_json(out) if logits else out
        return await self._stream(job, render, openai_style=False, client_id=req.request_id or None, threaded=logits)

    @api.post("/v2/models/{model}/infer", openapi_extra=openapi.body(triton.InferRequest))
    @api.post("/v2/models/{model}/versions/{version}/infer", openapi_extra=openapi.body(triton.InferRequest))
    async def infer(self, model: str, request: Request, version: str = triton.MODEL_VERSION):
        """KServe v2 inference with the ensemble's tensors (text_input, max_tokens, ... -> text_output),
        as JSON or with the binary tensor data extension (tritonclient's default)."""
        try:
            body, binary = triton_binary.decode_request(await self._body(request),
                                                        request.headers.get(triton_binary.HEADER))
            fields, request_id, wanted = triton.infer_to_generate_body(body)
            if request_id:  # KServe's id is Triton's request id: a stop request names it
                fields.setdefault("request_id", request_id)
            if await self._stop(model, fields):
                generated = triton.stop_response(model)
            else:
                job, req = triton.parse_generate(model, fields, self.name, self.config.max_tokens_default,
                                                 streams=False)
                chunk, ids = await self._whole(job, req.request_id or None)
                generated = triton.generate_response(model, req, chunk, job.prompt or "", ids, final=True)
        except Exception as exc:  # noqa: BLE001
            return self._error(exc, openai_style=False)
        response = triton.infer_response(model, request_id, generated, wanted)
        logits = any(o["name"] in triton.LOGITS_OUTPUTS for o in response["outputs"])
        encoded = await asyncio.to_thread(triton_binary.encode_response, response, binary) if logits \
            else triton_binary.encode_response(response, binary)
        if encoded is None:
            return await _json_off_loop(response) if logits else response
        content, json_length = encoded
        return Response(content, media_type="application/octet-stream",
                        headers={triton_binary.HEADER: str(json_length)})

    # -- OpenAI ------------------------------------------------------------------------------------
    @api.get("/v1/models")
    async def list_models(self):
        return openai.models_list([self.name, *self.config.lora_adapters])

    async def _openai(self, request: Request, chat: bool):
        try:
            body = await self._json(request)
            job, req = openai.parse_chat(body, self.config.max_tokens_default) if chat else \
                openai.parse_completion(body, self.config.max_tokens_default, self.config.max_return_sequences)
            if req.model in self.config.lora_adapters:
                job.adapter = AdapterRef(req.model, None, "model")
            elif req.model != self.name:
                names = ", ".join([self.name, *self.config.lora_adapters])
                raise InvalidRequestError("model", f"unknown model '{req.model}'; this server has: {names}")
            if chat and req.calls_tools() and self.tool_parser is None:
                self.tool_parser = await self.tokenizer.tool_call_parser.remote()
            calls = openai.tool_calls(req, self.tool_parser) if chat else None
        except Exception as exc:  # noqa: BLE001
            return self._error(exc, openai_style=True)
        choices = None if chat else openai.CompletionChoices(req)
        if req.stream:
            state = openai.StreamState(req, job.request_id, self.name, chat)
            return await self._stream(
                job, lambda chunk, ids: openai.completion_response(job.request_id, self.name, chunk, chat, state,
                                                                   calls, choices),
                openai_style=True, done_marker=True, trailer=state.usage_chunk)
        try:
            chunk, _ = await self._whole(job)
        except Exception as exc:  # noqa: BLE001
            return self._error(exc, openai_style=True)
        return openai.completion_response(job.request_id, self.name, chunk, chat, None, calls, choices)

    @api.post("/v1/completions", openapi_extra=openapi.body(openai.CompletionRequest))
    async def completions(self, request: Request):
        return await self._openai(request, chat=False)

    @api.post("/v1/chat/completions", openapi_extra=openapi.body(openai.ChatRequest))
    async def chat_completions(self, request: Request):
        return await self._openai(request, chat=True)

    # -- operations --------------------------------------------------------------------------------
    @api.get("/stats")
    async def stats(self):
        return await self.engine.stats.remote()
