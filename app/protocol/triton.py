"""Triton's generate extension as the TensorRT-LLM model repository uses it.

Model names: the configured one and `ensemble` / `tensorrt_llm_bls` take text (text_input) and
return text_output; `tensorrt_llm` takes text the llmapi way (text_input + sampling_param_*) or
token ids the inflight_batcher way (input_ids + request_output_len) and then returns output_ids.
Fields may sit at the top level or under "parameters" (Triton merges both).

Logits (return_context_logits, return_generation_logits) stay float32 numpy arrays up to here;
to_json prints them, /infer's binary tensors send their bytes.
"""
from __future__ import annotations

import json
import math
import uuid
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from app.engine.errors import InvalidRequestError
from app.engine.guided import Guide
from app.engine.sampling_params import SamplingParams
from app.protocol.body import TokenId
from app.protocol.messages import AdapterRef, GenerationJob, TextChunk

TEXT_MODELS = ("ensemble", "tensorrt_llm_bls")
IDS_MODEL = "tensorrt_llm"
MODEL_VERSION = "1"
LOGITS_OUTPUTS = ("context_logits", "generation_logits")  # float32 numpy arrays in a response
# TensorRT-LLM's perf metrics outputs -> RequestMetrics' fields
PERF_OUTPUTS = {
    "kv_cache_reused_block": "kv_cache_reused_blocks", "kv_cache_hit_rate": "kv_cache_hit_rate",
    "kv_cache_alloc_new_blocks": "kv_cache_alloc_new_blocks",
    "kv_cache_alloc_total_blocks": "kv_cache_alloc_total_blocks",
    "arrival_time_ns": "arrival_time_ns", "first_scheduled_time_ns": "first_scheduled_time_ns",
    "first_token_time_ns": "first_token_time_ns", "last_token_time_ns": "last_token_time_ns",
    "acceptance_rate": "acceptance_rate", "total_accepted_draft_tokens": "total_accepted_draft_tokens",
    "total_draft_tokens": "total_draft_tokens"}
# Every output a response may carry: what /infer's `outputs` may ask for
OUTPUTS = ("text_output", "output_ids", "sequence_length", "cum_log_probs", "output_log_probs", "batch_index",
           "sequence_index", "sequence_start", "sequence_end", "sequence_id", "finish_reason", "stop_reason",
           *LOGITS_OUTPUTS, *PERF_OUTPUTS)

# Alternative spellings used by the seeds' models -> our field name.
ALIASES = {
    "request_output_len": "max_tokens", "runtime_top_k": "top_k", "runtime_top_p": "top_p",
    "len_penalty": "length_penalty", "streaming": "stream",
    "sampling_param_max_tokens": "max_tokens", "sampling_param_temperature": "temperature",
    "sampling_param_top_k": "top_k", "sampling_param_top_p": "top_p",
    "sampling_param_frequency_penalty": "frequency_penalty", "sampling_param_presence_penalty": "presence_penalty",
    "sampling_param_seed": "seed", "sampling_param_stop": "stop_words", "sampling_param_best_of": "best_of",
    "sampling_param_exclude_input_from_output": "exclude_input_in_output",
    "sampling_param_return_perf_metrics": "return_perf_metrics", "sampling_param_min_tokens": "min_tokens",
    "sampling_param_repetition_penalty": "repetition_penalty", "stop_words_list": "stop_token_ids",
    "bad_words_list": "bad_token_ids", "sampling_param_n": "num_return_sequences",
}


LIST_FIELDS = ("input_ids", "stop_token_ids", "bad_token_ids", "bad_words", "stop_words")


def _one(value):
    """A scalar sent as a Triton batch of one ([x] or [[x]]) -> x."""
    while isinstance(value, list) and len(value) == 1:
        value = value[0]
    return value


class TritonGenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text_input: str | None = None
    input_ids: list[TokenId] | None = None
    input_lengths: int | None = Field(None, ge=1)  # ids past it are padding, as TensorRT-LLM reads them
    max_tokens: int | None = Field(None, ge=1)
    bad_words: list[str] | None = None
    stop_words: list[str] | None = None
    stop_token_ids: list[list[int]] | None = None
    bad_token_ids: list[list[int]] | None = None
    end_id: int | None = Field(None, ge=0)
    pad_id: int | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    temperature: float | None = Field(None, ge=0.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    length_penalty: float | None = None
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    min_tokens: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0)
    beam_width: int | None = Field(None, ge=1)
    best_of: int | None = Field(None, ge=1)
    num_return_sequences: int | None = Field(None, ge=1)
    stream: bool | None = None  # generate_stream: false sends the whole answer as one event
    ignore_eos: bool | None = None  # ours, for benchmarks: generate max_tokens whatever the model says
    stop: bool | None = None  # true: a stop request for the id in flight (parse_stop), never a generation
    exclude_input_in_output: bool | None = None
    return_log_probs: bool | None = None
    return_perf_metrics: bool | None = None
    return_context_logits: bool | None = None  # context_logits: [prompt tokens][vocab]
    return_generation_logits: bool | None = None  # generation_logits: [outputs][output tokens][vocab]
    request_id: str | None = Field(None, max_length=256)  # as KServe's id; the app holds those in flight
    lora_task_id: int | str | None = None
    lora_path: str | None = None
    lora_id: int | str | None = None  # llmapi: lora_id + lora_name + lora_path together
    lora_name: str | None = None
    guided_decoding_guide_type: Literal["json", "json_schema", "regex", "ebnf_grammar", "structural_tag"] | None = None
    guided_decoding_guide: str | None = None

    @field_validator("bad_words", "stop_words", mode="before")
    @classmethod
    def _words(cls, v):
        v = _batch_of_one(v)
        if v is None or v == "":
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("input_ids", mode="before")
    @classmethod
    def _ids(cls, v):
        return _batch_of_one(v)

    @field_validator("stop_token_ids", "bad_token_ids", mode="before")
    @classmethod
    def _id_lists(cls, v):
        return [v] if isinstance(v, list) and v and isinstance(v[0], int) else v


def _batch_of_one(value):
    """[[...]] (a Triton batch of one) -> [...]; a batch of more is refused, never cut to its first row."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        if len(value) > 1:
            raise ValueError(f"is a batch of {len(value)}; send one request per call")
        return value[0]
    return value


def _fields(model: str, body: Any, served_name: str) -> dict:
    """A body's fields for `model`, from the top level and "parameters", under our names."""
    if model not in (served_name, *TEXT_MODELS, IDS_MODEL):
        raise InvalidRequestError("model", f"unknown model '{model}'; this server has "
                                           f"'{served_name}', {', '.join(TEXT_MODELS)}, '{IDS_MODEL}'")
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    parameters = body.get("parameters")
    parameters = {} if parameters is None else parameters
    if not isinstance(parameters, dict):
        raise InvalidRequestError("parameters", "must be a JSON object")
    top = {k: v for k, v in body.items() if k != "parameters"}
    fields: dict[str, Any] = {}
    # One value per field: a field given twice (at the top and in parameters, or under two of its
    # names) must say the same both times, or the request is refused naming it.
    for key, value in [*parameters.items(), *top.items()]:
        name = ALIASES.get(key, key)
        if name in fields and not _same(fields[name], value):
            raise InvalidRequestError(key, f"is given twice, as '{name}' too, with different values")
        fields[name] = value
    return {k: v if k in LIST_FIELDS else _one(v) for k, v in fields.items()}


def _same(a, b) -> bool:
    """Two spellings of one value: 20, [20] and [[20]]; "", [] and None (no words)."""
    a, b = _one(a), _one(b)
    return a == b or (a in ("", [], None) and b in ("", [], None))


def parse_stop(model: str, body: Any, served_name: str) -> str | None:
    """The request id a stop request (`stop: true`) names, or None for a generate request. A stop
    request's other fields are ignored, as Triton's tensorrt_llm model ignores them (its clients
    send placeholder inputs with it)."""
    fields = _fields(model, body, served_name)
    if fields.get("stop") in (None, False):
        return None
    if fields["stop"] is not True:
        raise InvalidRequestError("stop", "must be a boolean")
    request_id = fields.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id", "is required with stop: the id of the request in flight to stop")
    return request_id


def parse_generate(model: str, body: Any, served_name: str, max_tokens_default: int | None,
                   streams: bool = False) -> tuple[GenerationJob, TritonGenerateRequest]:
    """Validate a generate body for `model` (after parse_stop found it is not a stop request) sent
    to an endpoint that `streams` (generate_stream) or answers once (generate, infer);
    InvalidRequestError names the field at fault."""
    fields = _fields(model, body, served_name)
    try:
        req = TritonGenerateRequest.model_validate(fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        message = "is not a field of this endpoint" if err["type"] == "extra_forbidden" else err["msg"]
        raise InvalidRequestError(where, message) from None
    if req.text_input is None and req.input_ids is None:
        raise InvalidRequestError("text_input", "is required (or input_ids for the tensorrt_llm model)")
    if req.stream and not streams:  # Triton refuses a decoupled model's stream where one response is due
        raise InvalidRequestError("stream", "true needs the generate_stream endpoint; this one answers once")
    if req.input_ids is not None and model != IDS_MODEL:
        raise InvalidRequestError("input_ids", f"is only taken by the '{IDS_MODEL}' model")
    if req.input_ids is not None and req.text_input is not None:
        raise InvalidRequestError("text_input", "goes without input_ids: send the prompt one way")
    if req.input_lengths is not None:
        if req.input_ids is None:
            raise InvalidRequestError("input_lengths", "goes with input_ids (how many of them are the prompt)")
        if req.input_lengths > len(req.input_ids):
            raise InvalidRequestError("input_lengths", f"{req.input_lengths} exceeds the {len(req.input_ids)} "
                                                       "input_ids sent")
        req.input_ids = req.input_ids[:req.input_lengths]
    # TensorRT-LLM's rule: a request that sets no sampling knob (top_k, top_p 0 or absent) decodes greedily.
    greedy = req.temperature == 0.0 or (not req.top_k and not req.top_p and req.temperature is None)
    n = req.num_return_sequences or _default_n(req)
    if req.best_of is not None and req.best_of != n:  # TensorRT-LLM: generate best_of, return the n likeliest
        raise InvalidRequestError("best_of", f"generating more sequences than are returned is not supported: "
                                             f"best_of must equal the number returned ({n})")
    params = SamplingParams(
        max_tokens=req.max_tokens or max_tokens_default, end_id=req.end_id, pad_id=req.pad_id,
        temperature=0.0 if greedy else (req.temperature if req.temperature is not None else 1.0),
        top_k=req.top_k or 0, top_p=req.top_p or 1.0, min_p=req.min_p or 0.0, seed=req.seed,
        repetition_penalty=req.repetition_penalty or 1.0, presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0, min_tokens=req.min_tokens or 0,
        stop_token_ids=req.stop_token_ids or [], bad_token_ids=req.bad_token_ids or [],
        logprobs=bool(req.return_log_probs), n=n,
        beam_width=req.beam_width or 1, ignore_eos=bool(req.ignore_eos), length_penalty=req.length_penalty if req.length_penalty is not None else 1.0,
        guide=_guide(req), return_context_logits=bool(req.return_context_logits),
        return_generation_logits=bool(req.return_generation_logits))
    # The engine's id is ours alone, whatever the client sent: the client's id (req.request_id) is
    # for stop requests, and may be reused as soon as its stream ends, while the engine may still
    # be aborting the request that had it.
    job = GenerationJob(request_id=uuid.uuid4().hex, params=params, prompt=req.text_input,
                        prompt_token_ids=req.input_ids, stop=req.stop_words or [], bad_words=req.bad_words or [],
                        adapter=_adapter(req))
    return job, req


def _guide(req: TritonGenerateRequest) -> Guide | None:
    """TensorRT-LLM's guided decoding inputs (its GuidedDecodingParams types); a structural_tag
    guide is its JSON text ({"structures": [{"begin", "schema", "end"}], "triggers": [...]})."""
    kind, spec = req.guided_decoding_guide_type, req.guided_decoding_guide
    if kind is None:
        if spec is not None:
            raise InvalidRequestError("guided_decoding_guide_type", "is required with guided_decoding_guide")
        return None
    if kind != "json" and not spec:
        raise InvalidRequestError("guided_decoding_guide", f"is required for guide type {kind}")
    if kind == "json" and spec:  # TensorRT-LLM's json type is any JSON object: a schema would be dropped
        raise InvalidRequestError("guided_decoding_guide", "is not taken with guide type json (any JSON "
                                                           "object); for a schema, use guide type json_schema")
    return Guide({"ebnf_grammar": "ebnf"}.get(kind, kind), spec or "", "guided_decoding_guide")


def _default_n(req) -> int:
    """Triton returns every beam unless num_return_sequences says fewer."""
    return req.beam_width if (req.beam_width or 1) > 1 else 1


def _adapter(req: TritonGenerateRequest) -> AdapterRef | None:
    if req.lora_id is not None or req.lora_name is not None:
        if req.lora_id is None or req.lora_name is None:
            raise InvalidRequestError("lora_id", "lora_id and lora_name go together (with lora_path on first use)")
        return AdapterRef(req.lora_name, req.lora_path, "lora_name")
    if req.lora_task_id is not None:
        return AdapterRef(str(req.lora_task_id), req.lora_path, "lora_task_id")
    if req.lora_path is not None:
        raise InvalidRequestError("lora_path", "needs lora_task_id (or lora_id + lora_name) to name the adapter")
    return None


def generate_response(model: str, req: TritonGenerateRequest, chunk: TextChunk, prompt_text: str,
                      prompt_ids: list[int], final: bool) -> dict:
    """One response object (the whole answer, or one streamed delta)."""
    out: dict[str, Any] = {"model_name": model, "model_version": MODEL_VERSION}
    texts = [o.text for o in chunk.outputs]
    if req.exclude_input_in_output is False and final:
        texts = [prompt_text + t for t in texts]
    out["text_output"] = texts[0] if len(texts) == 1 else texts
    if req.input_ids is not None:
        ids = [o.token_ids if req.exclude_input_in_output or not final else prompt_ids + o.token_ids
               for o in chunk.outputs]
        out["output_ids"] = ids[0] if len(ids) == 1 else ids
        out["sequence_length"] = len(ids[0])
    cum = [o.cumulative_logprob for o in chunk.outputs]
    out["cum_log_probs"] = cum[0] if len(cum) == 1 else cum
    out["output_log_probs"] = [lp for o in chunk.outputs for lp in (o.logprobs or [])] if req.return_log_probs \
        else [0.0] * sum(len(o.token_ids) for o in chunk.outputs)
    indices = [o.index for o in chunk.outputs]  # TensorRT-LLM's: which of the request's outputs each is
    out.update(batch_index=0, sequence_index=indices[0] if len(indices) == 1 else indices, sequence_start=False,
               sequence_end=final, sequence_id=0)
    first = chunk.outputs[0] if chunk.outputs else None  # none: a last chunk whose outputs all ended before
    if first is not None and first.finish_reason is not None:
        out["finish_reason"] = first.finish_reason
        out["stop_reason"] = first.stop_reason
    if req.return_context_logits and chunk.context_logits is not None:  # with the first chunk
        out["context_logits"] = chunk.context_logits
    if req.return_generation_logits:  # each output's rows (none where it has no new token)
        out["generation_logits"] = [o.generation_logits if o.generation_logits is not None else []
                                    for o in chunk.outputs]
    if req.return_perf_metrics and chunk.metrics is not None:
        out.update({name: getattr(chunk.metrics, field) for name, field in PERF_OUTPUTS.items()})
    return out


def returns_logits(req: TritonGenerateRequest) -> bool:
    return bool(req.return_context_logits or req.return_generation_logits)


def to_json(obj: Any) -> bytes:
    """JSON of a response whose logits are numpy arrays, as compact as json.dumps(ensure_ascii=False,
    separators=(",", ":")). A float32 prints as %.9g, its exact round trip (~12 bytes, where a
    double's repr takes ~20, in half json.dumps's time), and a non-finite one as null. Rows are
    printed one at a time: a thread rendering a large answer lets the event loop run between rows."""
    parts: list[str] = []
    _json_parts(obj, parts.append)
    return "".join(parts).encode()


def _json_parts(obj: Any, out) -> None:
    if isinstance(obj, np.ndarray):
        if obj.ndim > 1:
            out("[")
            for i, row in enumerate(obj):
                out("," if i else "")
                _json_parts(row, out)
            out("]")
        elif np.isfinite(obj).all():
            out("[" + ",".join(map("%.9g".__mod__, obj.tolist())) + "]")
        else:
            out(json.dumps([float("%.9g" % v) if math.isfinite(v) else None for v in obj.tolist()]))
    elif isinstance(obj, dict):
        out("{")
        for i, (key, value) in enumerate(obj.items()):
            out(("," if i else "") + json.dumps(str(key), ensure_ascii=False) + ":")
            _json_parts(value, out)
        out("}")
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple, np.ndarray)) for v in obj):
        out("[")
        for i, value in enumerate(obj):
            out("," if i else "")
            _json_parts(value, out)
        out("]")
    else:
        out(json.dumps(obj, ensure_ascii=False, separators=(",", ":")))


def stop_response(model: str) -> dict:
    """What a stop request gets back: Triton's tensorrt_llm model answers it with an empty response
    (the stopped request's own stream ends with its final response)."""
    return {"model_name": model, "model_version": MODEL_VERSION}


# KServe v2 datatypes -> the JSON values their data may hold (bool is an int in Python: kept apart)
DATATYPES = {"BOOL": (bool,), "BYTES": (str,), "BF16": (float, int), "FP16": (float, int), "FP32": (float, int),
             "FP64": (float, int), **{f"{s}INT{b}": (int,) for s in ("", "U") for b in (8, 16, 32, 64)}}


UNSERVED_TENSOR_PARAMETERS = frozenset({"shared_memory_region", "shared_memory_byte_size", "shared_memory_offset",
                                        "classification"})


class InferTensor(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    shape: list[int] | None = None
    datatype: str | None = None
    data: list
    parameters: dict[str, Any] | None = None


class InferOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    """KServe v2 /infer, JSON tensors (binary ones are decoded into these by triton_binary)."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, max_length=256)
    parameters: dict[str, Any] | None = None
    inputs: list[InferTensor] = Field(min_length=1)
    outputs: list[InferOutput] | None = None


def infer_to_generate_body(body: Any) -> tuple[dict, str | None, list[str] | None]:
    """KServe v2 /infer: tensors in -> a generate body; also the request id and the outputs asked for."""
    try:
        req = InferRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise InvalidRequestError(where, "is not a field of /infer" if err["type"] == "extra_forbidden"
                                  else err["msg"]) from None
    fields = dict(req.parameters or {})
    # Triton acts on these tensor parameters besides the binary extension's (triton_binary took those
    # out) and ignores the rest (a codec's content_type); this server has no shared memory or
    # classification outputs.
    for where, tensors in (("inputs", req.inputs), ("outputs", req.outputs or [])):
        for i, tensor in enumerate(tensors):
            for key in UNSERVED_TENSOR_PARAMETERS.intersection(tensor.parameters or ()):
                raise InvalidRequestError(f"{where}.{i}.parameters.{key}", "is not supported by this server")
    for i, tensor in enumerate(req.inputs):
        _check_tensor(tensor, f"inputs.{i}")
        if tensor.name in fields:
            raise InvalidRequestError(f"inputs.{i}.name", f"'{tensor.name}' is given twice")
        fields[tensor.name] = tensor.data if tensor.name in LIST_FIELDS else _one(tensor.data)
    wanted = [o.name for o in req.outputs] if req.outputs else None
    for i, name in enumerate(wanted or ()):
        if name not in OUTPUTS:  # Triton's answer to an output the model does not have
            raise InvalidRequestError(f"outputs.{i}.name", f"'{name}' is not an output of this model; its outputs "
                                                           f"are {', '.join(OUTPUTS)}")
    return fields, req.id, wanted


MAX_DIMS = 8


def element_count(shape: list[int], where: str, most: int) -> int:
    """The elements `shape` holds, where that is at most `most` (what the data could fill). An
    untrusted shape never costs a huge product: at most MAX_DIMS dimensions, and the product stops
    once it passes `most`."""
    if len(shape) > MAX_DIMS:
        raise InvalidRequestError(f"{where}.shape", f"has {len(shape)} dimensions; at most {MAX_DIMS}")
    if any(d < 0 for d in shape):
        raise InvalidRequestError(f"{where}.shape", "dimensions must be >= 0")
    if 0 in shape:
        return 0
    count = 1
    for d in shape:
        count *= d
        if count > most:
            raise InvalidRequestError(f"{where}.shape", f"{shape} holds more elements than the data can fill ({most})")
    return count


def _check_tensor(tensor: InferTensor, where: str) -> None:
    """Data must fill the shape (row-major, nested or flat) with values of the datatype."""
    flat = _flatten(tensor.data)
    if tensor.shape is not None:
        count = element_count(tensor.shape, where, len(flat))
        if count != len(flat):
            raise InvalidRequestError(f"{where}.shape", f"{tensor.shape} holds {count} elements but data has {len(flat)}")
    if tensor.datatype is not None:
        kinds = DATATYPES.get(tensor.datatype)
        if kinds is None:
            raise InvalidRequestError(f"{where}.datatype", f"'{tensor.datatype}' is not a KServe v2 datatype; "
                                                           f"one of {', '.join(DATATYPES)}")
        if any(not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds) for v in flat):
            raise InvalidRequestError(f"{where}.data", f"holds a value that is not {tensor.datatype}")


def _flatten(data: list) -> list:
    return [x for value in data for x in (_flatten(value) if isinstance(value, list) else (value,))]


def _tensor(name: str, value) -> dict:
    if name in LOGITS_OUTPUTS:
        return _logits_tensor(name, value)
    data = value if isinstance(value, list) else [value]
    sample = data[0] if data else 0.0
    if isinstance(sample, list):
        shape, data = [len(data), len(sample)], [x for row in data for x in row]
        sample = data[0] if data else 0
    else:
        shape = [1, len(data)]
    datatype = ("BYTES" if isinstance(sample, str) else "BOOL" if isinstance(sample, bool)
                else "INT64" if isinstance(sample, int) else "FP32")
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


def _logits_tensor(name: str, value: np.ndarray | list) -> dict:
    """TensorRT-LLM's shapes with the batch of one: context_logits [1, prompt tokens, vocab],
    generation_logits [1, outputs, output tokens, vocab] (shorter outputs padded with zeros)."""
    if name == "context_logits":
        data = value[None]
    else:
        rows = [r for r in value if len(r)]
        vocab = rows[0].shape[1] if rows else 0
        data = np.zeros((1, len(value), max(map(len, value), default=0), vocab), np.float32)
        for i, r in enumerate(value):
            if len(r):  # an output with no new token has no rows: []
                data[0, i, :len(r)] = r
    return {"name": name, "datatype": "FP32", "shape": list(data.shape), "data": data}


def infer_response(model: str, request_id: str | None, generated: dict, wanted: list[str] | None) -> dict:
    skip = {"model_name", "model_version"}
    outputs = [_tensor(k, v) for k, v in generated.items()
               if k not in skip and v is not None and (wanted is None or k in wanted)]
    out = {"model_name": model, "model_version": MODEL_VERSION, "outputs": outputs}
    if request_id is not None:
        out["id"] = request_id
    return out
