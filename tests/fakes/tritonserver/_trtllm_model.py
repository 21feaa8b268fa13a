"""The TensorRT-LLM backend's `tensorrt_llm` model as Triton runs it (decoupled): inputs checked
against config.pbtxt as Triton checks them, then the behaviours the backend documents: new tokens
per response when streaming, one response per sequence (sequence_index), `final` on the last one
only, no finish reason, stop words kept in output_ids, no end_id meaning no end token, LoRA weights
sent with a task id's first request and cached (LRU) after, perf metrics on request, logits on
request where config.pbtxt declares the outputs (model_instance_state.cc: context_logits
[1, prompt, vocab] once the context phase is done, generation_logits [1, tokens, beams, vocab]
streaming or [1, beams, tokens, vocab] not; kept stop words keep their rows). Guided
decoding (guided_decoding_backend + xgrammar_tokenizer_info_path, read at load as
model_instance_state.cc does; the guided_decoding_guide_type/_guide inputs as utils.cc maps them)
is recorded, not enforced: the portable engine underneath runs unguided."""
from __future__ import annotations

import asyncio
import json
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
from tritonserver._api import DataType, InferenceResponse, InvalidArgumentError, Tensor, TritonError

from app.engine import SamplingParams
from app.engine.outputs import merge_outputs
from app.engine.model_loader import read_model_config
from app.engine.outputs import RequestOutput
from tests.fakes._engine import start_engine

CONFIG_TYPES = {"TYPE_BOOL": DataType.BOOL, "TYPE_UINT64": DataType.UINT64, "TYPE_INT32": DataType.INT32,
                "TYPE_INT64": DataType.INT64, "TYPE_FP16": DataType.FP16, "TYPE_FP32": DataType.FP32,
                "TYPE_STRING": DataType.BYTES}
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")  # any other guide type is dropped, unguided


class _Request:
    def __init__(self):
        self.responses: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        if self.task is not None and not self.task.done():
            self.task.cancel()
            self.responses.put_nowait(InferenceResponse(None, final=True))


class TensorrtLlmModel:
    def __init__(self, config: dict):
        self.config = config
        p = config["parameters"]
        self.engine = start_engine(
            p["gpt_model_path"], max_batch_size=config["max_batch_size"],
            max_beam_width=int(p.get("max_beam_width", 1)),
            enable_block_reuse=p.get("enable_kv_cache_reuse") == "true",
            max_tokens=int(p["max_tokens_in_paged_kv_cache"]) if "max_tokens_in_paged_kv_cache" in p else None,
            policy=p.get("batch_scheduler_policy", "guaranteed_no_evict"),
            chunked=p.get("enable_chunked_context") == "true")
        self.lora_cache: OrderedDict[int, str] = OrderedDict()  # task id -> weights folder
        self.lora_cache_slots = 8
        self.guided_decoding = _guided_decoding_config(p)
        self.outputs = set(config.get("outputs", {}))  # what a request may be answered with
        self.vocab = read_model_config(Path(p["gpt_model_path"])).vocab_size
        self.requests: list[dict] = []  # each request's input arrays, for contract tests
        self.guides: list[tuple[str, str | None] | None] = []  # each request's guide as the executor gets it
        self._ids = 0
        self._folder = tempfile.TemporaryDirectory(prefix="fake-triton-lora-")

    # -- Triton's checks -----------------------------------------------------------------------------
    def _check(self, tensors: dict[str, Tensor]) -> None:
        declared = self.config["inputs"]
        for name, tensor in tensors.items():
            spec = declared.get(name)
            if spec is None:
                raise InvalidArgumentError(f"unexpected inference input '{name}' for model 'tensorrt_llm'")
            if CONFIG_TYPES[spec["type"]] != tensor.data_type:
                raise InvalidArgumentError(f"unexpected datatype {tensor.data_type.name} for inference input "
                                           f"'{name}', expecting {spec['type']}")
            if len(tensor.shape) != 1 + len(spec["dims"]) or tensor.shape[0] != 1 or any(
                    d != -1 and d != s for d, s in zip(spec["dims"], tensor.shape[1:])):
                raise InvalidArgumentError(f"unexpected shape for input '{name}' for model 'tensorrt_llm'. "
                                           f"Expected [-1,{spec['dims']}], got {list(tensor.shape)}")
        missing = [n for n, spec in declared.items() if not spec["optional"] and n not in tensors]
        if missing:
            raise InvalidArgumentError(f"expected {len(missing)} more inputs for model 'tensorrt_llm': {missing}")

    # -- the backend --------------------------------------------------------------------------------
    def infer(self, request_id: str | None, tensors: dict[str, Tensor]) -> _Request:
        self._check(tensors)
        values = {name: t.array[0] for name, t in tensors.items()}  # the batch dimension is 1
        self.requests.append(values)
        self.guides.append(_guide(values))
        scalar = lambda name, default: values[name].reshape(-1)[0].item() if name in values else default  # noqa: E731
        streaming = bool(scalar("streaming", False))
        if streaming and not self.config["decoupled"]:
            raise InvalidArgumentError("Streaming is only supported if model is deployed using decoupled mode.")
        if not scalar("exclude_input_in_output", False):
            raise InvalidArgumentError("this fake returns outputs without the input only (exclude_input_in_output)")
        prompt = values["input_ids"][:scalar("input_lengths", 0)].tolist()
        params = SamplingParams(
            max_tokens=scalar("request_output_len", 0), end_id=scalar("end_id", None), pad_id=scalar("pad_id", None),
            ignore_eos="end_id" not in values, temperature=scalar("temperature", 1.0), top_k=scalar("runtime_top_k", 0),
            top_p=scalar("runtime_top_p", 1.0), seed=scalar("seed", None), length_penalty=scalar("len_penalty", 1.0),
            repetition_penalty=scalar("repetition_penalty", 1.0), presence_penalty=scalar("presence_penalty", 0.0),
            frequency_penalty=scalar("frequency_penalty", 0.0), min_tokens=scalar("min_tokens", 0),
            stop_token_ids=_words(values.get("stop_words_list")), bad_token_ids=_words(values.get("bad_words_list")),
            logprobs=bool(scalar("return_log_probs", False)), beam_width=scalar("beam_width", 1),
            n=scalar("num_return_sequences", 1), logit_bias=_bias(values.get("embedding_bias")),
            return_context_logits=bool(scalar("return_context_logits", False)) and "context_logits" in self.outputs,
            return_generation_logits=bool(scalar("return_generation_logits", False))
            and "generation_logits" in self.outputs)
        self._ids += 1
        request = _Request()
        request.task = asyncio.get_running_loop().create_task(
            self._run(request, request_id or str(self._ids), prompt, params, streaming, values))
        return request

    async def _run(self, request: _Request, rid: str, prompt, params: SamplingParams, streaming: bool, values) -> None:
        put = request.responses.put_nowait
        try:
            adapter = await self._lora(values)
            perf = bool(values.get("return_perf_metrics", [False])[0])
            whole = None
            async for item in self.engine.generate(rid, prompt, params, adapter):
                outs = [self._kept_stop_words(c, params) for c in item.outputs]
                if params.beam_width > 1 or not streaming:
                    whole = merge_outputs(whole, RequestOutput(rid, outs, item.finished,
                                                               context_logits=item.context_logits))
                    if not item.finished:
                        continue
                    outs = whole.outputs
                responses = self._responses(outs, params, beams=params.beam_width > 1, streaming=streaming)
                context = (whole or item).context_logits  # not streaming: the whole request's, at its end
                if context is not None:  # with the first response after the context phase
                    responses = responses or [{}]
                    responses[0]["context_logits"] = context[None]
                if item.finished:
                    if not responses:
                        responses = [{}]
                    if perf and item.metrics is not None:
                        responses[-1].update(_metrics(item.metrics))
                for i, outputs in enumerate(responses):
                    put(InferenceResponse(None, rid, outputs={k: Tensor._from_object(v) for k, v in outputs.items()},
                                          final=item.finished and i == len(responses) - 1))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the backend reports a failed request in its final response
            put(InferenceResponse(None, rid, error=TritonError(str(exc)), final=True))

    def _responses(self, outs, params: SamplingParams, beams: bool, streaming: bool = True) -> list[dict]:
        if beams:  # one response, every beam
            width = max(len(c.token_ids) for c in outs)
            ids = np.full((1, len(outs), width), params.end_id or 0, dtype=np.int32)
            for b, c in enumerate(outs):
                ids[0, b, :len(c.token_ids)] = c.token_ids
            return [{"output_ids": ids, "sequence_length": np.array([[len(c.token_ids) for c in outs]], np.int32),
                     "cum_log_probs": np.array([[c.cumulative_logprob for c in outs]], np.float32),
                     "sequence_index": np.zeros((1, 1), np.int32)}]
        responses = []
        for c in outs:
            response = {"output_ids": np.array([[c.token_ids]], np.int32).reshape(1, 1, -1),
                        "sequence_length": np.array([[len(c.token_ids)]], np.int32),
                        "cum_log_probs": np.array([[c.cumulative_logprob]], np.float32),
                        "sequence_index": np.array([[c.index]], np.int32)}
            if params.logprobs:
                response["output_log_probs"] = np.array([[c.logprobs or []]], np.float32).reshape(1, 1, -1)
            if params.return_generation_logits and c.generation_logits is not None:
                rows = c.generation_logits  # [tokens, vocab]: one beam
                response["generation_logits"] = rows[None, :, None] if streaming else rows[None, None]
            responses.append(response)
        return responses

    def _kept_stop_words(self, c, params: SamplingParams):
        """TensorRT-LLM leaves a matched stop word in output_ids; the portable engine cuts it."""
        if c.finish_reason == "stop" and isinstance(c.stop_reason, list):
            c.token_ids = list(c.token_ids) + c.stop_reason
            if c.logprobs is not None:
                c.logprobs = list(c.logprobs) + [0.0] * len(c.stop_reason)
            if params.return_generation_logits:  # their rows as well (zeros here: the engine cut the real ones)
                rows = c.generation_logits if c.generation_logits is not None else np.zeros((0, self.vocab), np.float32)
                c.generation_logits = np.concatenate([rows, np.zeros((len(c.stop_reason), self.vocab), np.float32)])
        return c

    async def _lora(self, values) -> str | None:
        if "lora_task_id" not in values:
            return None
        task = int(values["lora_task_id"].reshape(-1)[0])
        if "lora_weights" in values and "lora_config" in values:
            folder = Path(self._folder.name) / str(task)
            folder.mkdir(exist_ok=True)
            np.save(folder / "model.lora_weights.npy", values["lora_weights"])
            np.save(folder / "model.lora_config.npy", values["lora_config"])
            await self.engine.add_lora(str(task), str(folder))
            self.lora_cache[task] = str(folder)
            while len(self.lora_cache) > self.lora_cache_slots:
                self.lora_cache.popitem(last=False)
        elif task not in self.lora_cache:
            raise TritonError(f"LoRA task {task} not found in cache. Please send LoRA weights with request")
        self.lora_cache.move_to_end(task)
        return str(task)

    def shutdown(self) -> None:
        self.engine.shutdown()
        self._folder.cleanup()


def _guided_decoding_config(parameters: dict) -> dict | None:
    """The executor's guided decoding config: both parameters set (else none), the tokenizer info
    file present and whole, xgrammar the only backend."""
    backend, path = parameters.get("guided_decoding_backend", ""), parameters.get("xgrammar_tokenizer_info_path", "")
    if not backend or backend.startswith("${") or not path or path.startswith("${"):
        return None
    if not Path(path).exists():
        raise TritonError(f"Xgrammar's tokenizer info path at {path} does not exist.")
    info = json.loads(Path(path).read_text())
    config = {"encoded_vocab": info["encoded_vocab"], "tokenizer_str": info["tokenizer_str"],
              "stop_token_ids": info["stop_token_ids"]}
    if backend != "xgrammar":
        raise TritonError("Guided decoding is currently supported with 'xgrammar' backend. Invalid "
                          "guided_decoding_backend parameter provided.")
    return config


def _guide(values: dict) -> tuple[str, str | None] | None:
    """(guide type, guide) of a request, None without a known guide type."""
    kind = values.get("guided_decoding_guide_type")
    if kind is None or kind.reshape(-1)[0].decode() not in GUIDE_TYPES:
        return None
    guide = values.get("guided_decoding_guide")
    return kind.reshape(-1)[0].decode(), None if guide is None else guide.reshape(-1)[0].decode()


def _bias(array) -> dict[int, float]:
    """embedding_bias ([vocab] once the batch dimension is gone; empty: none) as logit_bias."""
    if array is None or array.size == 0:
        return {}
    flat = array.reshape(-1)
    return {int(i): float(flat[i]) for i in np.flatnonzero(flat)}


def _words(array) -> list[list[int]]:
    if array is None:
        return []
    flat, offsets = array[0].tolist(), [o for o in array[1].tolist() if o >= 0]
    return [flat[a:b] for a, b in zip([0] + offsets[:-1], offsets)]


def _metrics(m) -> dict:
    one = lambda v, t: np.array([[v]], dtype=t)  # noqa: E731
    return {"arrival_time_ns": one(m.arrival_time_ns, np.int64),
            "first_scheduled_time_ns": one(m.first_scheduled_time_ns, np.int64),
            "first_token_time_ns": one(m.first_token_time_ns, np.int64),
            "last_token_time_ns": one(m.last_token_time_ns, np.int64),
            "kv_cache_reused_blocks": one(m.kv_cache_reused_blocks, np.int32),
            "kv_cache_alloc_new_blocks": one(m.kv_cache_alloc_new_blocks, np.int32),
            "kv_cache_alloc_total_blocks": one(m.kv_cache_alloc_total_blocks, np.int32)}
