"""Triton's in-process server (the `tritonserver` package) running the TensorRT-LLM backend's
`tensorrt_llm` model (inflight_batcher_llm: token ids in, token ids out) behind the engine protocol.

Written against the public tritonserver API (Server, Options, ModelControlMode, Model.async_infer,
Model.config, InferenceResponse.outputs/final/error, AsyncResponseIterator.cancel) and the
tensorrt_llm model's inputs, outputs and parameters (its config.pbtxt). Tested here against a fake
that follows them (tests/fakes/tritonserver); neither package can be installed on our machines.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from app.backends.base import (
    OBJECT_SCHEMA,
    AdapterTable,
    ServedModel,
    StopWatcher,
    bias_row,
    context_rows,
    generation_rows,
    import_backend_package,
    refuse_torch_only,
)
from app.backends.triton_repository import write_model_repository
from app.config import ServiceConfig
from app.engine.errors import BackendError, InvalidRequestError
from app.engine.guided import Guide
from app.engine.outputs import merge_outputs
from app.engine.lora_loader import load_peft_adapter, to_trtllm_arrays
from app.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from app.engine.sampling_params import SamplingParams, validate_request
from app.protocol.messages import AdapterRef

NOT_IN_CACHE = "not found in cache"  # the tensorrt_llm model's error for an evicted/unknown lora_task_id
# Our guide kinds as the model's guided_decoding_guide_type; it maps only these four (any other type
# is dropped, the request then unguided) and its C++ runtime has no structural tags.
GUIDE_TYPES = {"json": "json_schema", "json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf_grammar"}


def scalar(value, dtype) -> np.ndarray:
    """One request's scalar input: shape [1, 1] (batch dimension first, as max_batch_size > 0 needs)."""
    return np.array([[value]], dtype=dtype)


def words_list(sequences: list[list[int]]) -> np.ndarray:
    """stop_words_list / bad_words_list: [1, 2, N], the flattened ids and their end offsets (-1 padded)."""
    flat = [t for seq in sequences for t in seq]
    offsets = np.cumsum([len(seq) for seq in sequences]).tolist()
    width = max(len(flat), len(offsets))
    out = np.full((1, 2, width), -1, dtype=np.int32)
    out[0, 0, :len(flat)] = flat
    out[0, 1, :len(offsets)] = offsets
    return out


def text(value: str) -> np.ndarray:
    """One request's string input (TYPE_STRING, dims [1]): shape [1, 1], UTF-8 bytes."""
    return np.array([[value.encode("utf-8")]], dtype=object)


def guided_decoding_on(model_config: dict) -> bool:
    """Whether the loaded model decodes guided: both its parameters set, as the backend reads them
    (empty or a template's unfilled ${...} turns guided decoding off)."""
    params = model_config.get("parameters", {})
    values = [params.get(k, {}).get("string_value", "") for k in ("guided_decoding_backend",
                                                                   "xgrammar_tokenizer_info_path")]
    return all(v and not v.startswith("${") for v in values)


def adapter_arrays(path: str, max_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """lora_weights [rows, width] fp16 and lora_config [rows, 3] int32 from an adapter directory."""
    folder = Path(path)
    if (folder / "model.lora_weights.npy").is_file() and (folder / "model.lora_config.npy").is_file():
        weights = np.load(folder / "model.lora_weights.npy").astype(np.float16)
        config = np.load(folder / "model.lora_config.npy").astype(np.int32)
        return weights.reshape(config.reshape(-1, 3).shape[0], -1), config.reshape(-1, 3)
    return to_trtllm_arrays(load_peft_adapter(folder.name, folder, max_rank))


class TritonBackend:
    name = "triton"

    def __init__(self, config: ServiceConfig, adapters: dict[str, str]):
        tritonserver = import_backend_package("tritonserver", "tritonserver")
        section = config.triton
        self.served = ServedModel(config)
        self.eos_ids = self.served.eos_ids
        self.max_lora_rank = config.max_lora_rank
        repository = section.model_repository or write_model_repository(config)
        self.server = tritonserver.Server(model_repository=str(repository),
                                          model_control_mode=tritonserver.ModelControlMode.EXPLICIT,
                                          backend_directory=section.backend_directory, log_error=True)
        self.server.start(wait_until_ready=True, timeout=section.start_timeout_s)
        self.model = self.server.load(section.model_name)
        self.guided = guided_decoding_on(self.model.config())
        self.adapters = AdapterTable()
        self.lora_arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # task id -> weights, read once
        for name, path in adapters.items():  # read now: a broken adapter stops start-up, with its reason
            self.lora_arrays[self.adapters.register(name, path)] = adapter_arrays(path, self.max_lora_rank)
        self.lora_sent: set[int] = set()  # task ids whose weights Triton was given
        self.in_flight = 0

    async def add_lora(self, name: str, path: str) -> None:
        self.adapters.register(name, path)

    def inputs(self, prompt: list[int], params: SamplingParams) -> dict[str, np.ndarray]:
        """Our parameters as the tensorrt_llm model's input tensors."""
        if params.min_p:
            raise InvalidRequestError("min_p", "the triton backend's tensorrt_llm model has no min_p input")
        guide = self.guide_inputs(params.guide) if params.guide is not None else {}
        refuse_torch_only(params, "triton")
        end_id, extra_eos = self.served.end_ids(params)
        inputs = {
            "input_ids": np.array([prompt], dtype=np.int32),
            "input_lengths": scalar(len(prompt), np.int32),
            "request_output_len": scalar(params.max_tokens, np.int32),
            "pad_id": scalar(params.pad_id if params.pad_id is not None else self.eos_ids[0], np.int32),
            "beam_width": scalar(params.beam_width, np.int32),
            "temperature": scalar(params.temperature, np.float32),
            "runtime_top_k": scalar(1 if params.greedy else params.top_k, np.int32),
            "runtime_top_p": scalar(params.top_p, np.float32),
            "len_penalty": scalar(params.length_penalty, np.float32),
            "repetition_penalty": scalar(params.repetition_penalty, np.float32),
            "presence_penalty": scalar(params.presence_penalty, np.float32),
            "frequency_penalty": scalar(params.frequency_penalty, np.float32),
            "min_tokens": scalar(params.min_tokens, np.int32),
            "num_return_sequences": scalar(params.n, np.int32),
            "streaming": scalar(params.beam_width == 1, bool),  # beams are rewritten: taken whole at the end
            "exclude_input_in_output": scalar(True, bool),
            "return_log_probs": scalar(params.logprobs, bool),
            "return_perf_metrics": scalar(True, bool),
            "return_context_logits": scalar(params.return_context_logits, bool),
            "return_generation_logits": scalar(params.return_generation_logits, bool),
        }
        # No end_id input means no end token, which is what ignore_eos asks for.
        if not params.ignore_eos:
            inputs["end_id"] = scalar(end_id, np.int32)
        if params.seed is not None:
            inputs["seed"] = scalar(params.seed, np.uint64)
        stops = self.stop_sequences(params, extra_eos)
        if stops:
            inputs["stop_words_list"] = words_list(stops)
        if params.bad_token_ids:
            inputs["bad_words_list"] = words_list(params.bad_token_ids)
        if params.logit_bias:  # [1, vocab]: the model squeezes the batch dimension away
            inputs["embedding_bias"] = bias_row(params.logit_bias, self.served.limits.vocab_size)[None]
        return {**inputs, **guide}

    def guide_inputs(self, guide: Guide) -> dict[str, np.ndarray]:
        """guided_decoding_guide_type and guided_decoding_guide, the guide checked first (400 if it
        does not parse, or if the model cannot follow it)."""
        if guide.kind not in GUIDE_TYPES:
            raise InvalidRequestError(guide.field, "the triton backend's tensorrt_llm model takes json, json_schema, "
                                                   f"regex and ebnf_grammar guides, not {guide.kind}")
        if not self.guided:
            raise InvalidRequestError(guide.field, "guided decoding is off in this Triton model repository (its "
                                                   "config.pbtxt sets no guided_decoding_backend and "
                                                   "xgrammar_tokenizer_info_path)")
        self.served.check_guide(guide)
        return {"guided_decoding_guide_type": text(GUIDE_TYPES[guide.kind]),
                "guided_decoding_guide": text(OBJECT_SCHEMA if guide.kind == "json" else guide.spec)}

    def stop_sequences(self, params: SamplingParams, extra_eos: list[int] | None = None) -> list[list[int]]:
        """Stop words, plus the model's other end ids (end_id takes one)."""
        extra = self.served.end_ids(params)[1] if extra_eos is None else extra_eos
        return [list(s) for s in params.stop_token_ids] + [[e] for e in extra]

    def lora_inputs(self, adapter: AdapterRef, with_weights: bool) -> dict[str, np.ndarray]:
        task_id, path = self.adapters.resolve(adapter)
        inputs = {"lora_task_id": scalar(task_id, np.uint64)}
        if with_weights or task_id not in self.lora_sent:
            if task_id not in self.lora_arrays:
                self.lora_arrays[task_id] = adapter_arrays(path, self.max_lora_rank)
            weights, config = self.lora_arrays[task_id]
            inputs["lora_weights"], inputs["lora_config"] = weights[None], config[None]
        return inputs

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       adapter: AdapterRef | None = None):
        params = validate_request(prompt_token_ids, params, self.served.limits)
        inputs = self.inputs(prompt_token_ids, params)
        self.in_flight += 1
        try:
            for attempt in range(2):
                lora = self.lora_inputs(adapter, with_weights=attempt > 0) if adapter is not None else {}
                try:
                    responses = self.model.async_infer(inputs={**inputs, **lora}, request_id=request_id)
                except Exception as exc:  # noqa: BLE001 - Triton refused the request's tensors
                    raise BackendError(self.name, str(exc)) from None
                stream = _Stream(self, request_id, params, len(prompt_token_ids))
                try:
                    async for output in stream.outputs(responses):
                        if lora:
                            self.lora_sent.add(int(lora["lora_task_id"][0, 0]))
                        yield output
                    return
                except BackendError as exc:
                    # Evicted from Triton's LoRA cache before any token came: send the weights again, once.
                    if adapter is None or attempt > 0 or NOT_IN_CACHE not in exc.message or stream.started:
                        raise
                    self.lora_sent.discard(int(lora["lora_task_id"][0, 0]))
        finally:
            self.in_flight -= 1

    def stats(self) -> dict:
        return {"backend": self.name, "healthy": self.healthy, "num_running": self.in_flight,
                "lora": {"host": list(self.adapters.paths), "device": sorted(self.lora_sent)}}

    @property
    def healthy(self) -> bool:
        return self.server.ready() and self.model.ready()

    def shutdown(self) -> None:
        self.server.stop()


class _Stream:
    """One request's decoupled responses turned into our deltas.

    The tensorrt_llm model streams new tokens per response (one sequence per response, named by
    sequence_index), marks only the last response `final`, and reports no finish reason; a final
    response may carry no outputs. Stop words stop it natively but stay in its output, so a
    StopWatcher per sequence holds back and cuts them (with their logits rows) as the portable
    engine does. Logits, where asked: context_logits [1, prompt, vocab padded] on a response after
    the context phase (sent once, with the first delta that has them); generation_logits per
    response, [1, tokens, beams, vocab padded] streaming or [1, beams, tokens, vocab padded] not
    (executor Result.generationLogits with the batch dimension first): one beam here either way."""

    def __init__(self, backend: TritonBackend, request_id: str, params: SamplingParams, num_prompt: int):
        self.backend, self.request_id, self.params, self.num_prompt = backend, request_id, params, num_prompt
        self.stops = backend.stop_sequences(params)
        self.watchers: dict[int, StopWatcher] = {}
        self.counts: dict[int, int] = {}
        self.cumulative: dict[int, float] = {}
        self.done: set[int] = set()
        self.started = False
        self.context_due = params.return_context_logits
        self.vocab = backend.served.limits.vocab_size
        self.perf = None  # the latest response carrying perf metrics (a final response may carry none)

    async def outputs(self, responses):
        final = False
        try:
            async for response in self._checked(responses):
                completions = []
                if response.outputs:
                    self.started = True
                    self.perf = response if "arrival_time_ns" in response.outputs else self.perf
                    completions = self._completions(response)
                if response.final:
                    closing = range(self.params.n if self.params.beam_width == 1 else 0)
                    completions += [self._close(i) for i in closing if i not in self.done]
                final = response.final
                finished = final or len(self.done) == self.params.n
                context = self._context(response) if self.context_due and response.outputs else None
                if completions or finished or context is not None:
                    delta = RequestOutput(self.request_id, [], finished)
                    for completion in completions:  # one entry per output index
                        delta = merge_outputs(delta, RequestOutput(self.request_id, [completion], finished))
                    delta.context_logits = context
                    delta.metrics = self._metrics(self.perf) if finished and self.perf is not None else None
                    yield delta
                if finished:
                    return
        finally:
            if not final:
                responses.cancel()  # the client left, or stop sequences ended it: Triton stops the request

    async def _checked(self, responses):
        try:
            async for response in responses:
                if response.error is not None:
                    raise BackendError(self.backend.name, str(response.error))
                yield response
        except BackendError:
            raise
        except Exception as exc:  # noqa: BLE001 - Triton's own error, passed on in its words
            raise BackendError(self.backend.name, str(exc)) from None

    def _context(self, response) -> np.ndarray | None:
        """The prompt's logits rows, [prompt, vocab], from the first response that has them."""
        logits = _array(response, "context_logits")
        if logits is None:
            return None
        self.context_due = False
        return context_rows(logits, self.num_prompt, self.vocab, self.backend.name)

    def _rows(self, response, num_tokens: int) -> np.ndarray | None:
        """This response's generation logits, one row per new token (rows past them dropped)."""
        if not self.params.return_generation_logits:
            return None
        return generation_rows(_array(response, "generation_logits"), num_tokens, self.vocab, self.backend.name,
                               "is the engine built with --gather_generation_logits?")

    def _completions(self, response) -> list[CompletionOutput]:
        ids = _array(response, "output_ids")[0]  # [beams, tokens]
        lengths = _array(response, "sequence_length")[0]
        logprobs = _array(response, "output_log_probs") if self.params.logprobs else None
        cum = _array(response, "cum_log_probs")
        index = int(_array(response, "sequence_index", np.zeros((1, 1)))[0][0])
        out = []
        for beam in range(ids.shape[0]):
            n = int(lengths[beam])
            tokens = ids[beam, :n].tolist()
            probs = logprobs[0, beam, :n].tolist() if logprobs is not None else None
            cumulative = float(cum[0, beam]) if cum is not None else 0.0
            if self.params.beam_width > 1:  # one final response holding every beam whole, best first
                if beam >= self.params.n:
                    break
                self.done.add(beam)
                out.append(CompletionOutput(beam, tokens, probs, cumulative, *self._finish(len(tokens))))
                continue
            if index in self.done:
                continue
            watcher = self.watchers.setdefault(index, StopWatcher(self.stops, self.params.min_tokens))
            self.counts[index] = self.counts.get(index, 0) + len(tokens)
            self.cumulative[index] = cumulative
            rows = self._rows(response, len(tokens))
            tokens, probs, rows, matched = watcher.push(tokens, probs, final=False, logits=rows)
            finish, reason = None, None
            if matched is not None:
                self.done.add(index)
                finish, reason = "stop", (matched[0] if matched[0] in self.backend.eos_ids else matched)
            out.append(CompletionOutput(index, tokens, probs, cumulative, finish, reason, generation_logits=rows))
        return out

    def _close(self, index: int) -> CompletionOutput:
        """The end of a sequence the final response closed: held tokens flushed, finish reason inferred."""
        self.done.add(index)
        watcher = self.watchers.setdefault(index, StopWatcher(self.stops, self.params.min_tokens))
        held = np.zeros((0, self.vocab), np.float32) if self.params.return_generation_logits else None
        tokens, probs, rows, _ = watcher.push([], [] if self.params.logprobs else None, final=True, logits=held)
        return CompletionOutput(index, tokens, probs, self.cumulative.get(index, 0.0),
                                *self._finish(self.counts.get(index, 0)), generation_logits=rows)

    def _finish(self, generated: int) -> tuple[str, int | None]:
        """Under max_tokens with an end id set means the end id ended it."""
        if generated >= self.params.max_tokens or self.params.ignore_eos:
            return "length", None
        return "stop", self.backend.served.end_ids(self.params)[0]

    def _metrics(self, response) -> RequestMetrics:
        value = lambda name: int(_array(response, name).reshape(-1)[0])  # noqa: E731
        return RequestMetrics(arrival_time_ns=value("arrival_time_ns"),
                              first_scheduled_time_ns=value("first_scheduled_time_ns"),
                              first_token_time_ns=value("first_token_time_ns"),
                              last_token_time_ns=value("last_token_time_ns"), num_prompt_tokens=self.num_prompt,
                              num_output_tokens=sum(self.counts.values()),
                              kv_cache_reused_blocks=value("kv_cache_reused_blocks"),
                              kv_cache_alloc_new_blocks=value("kv_cache_alloc_new_blocks"))


def _array(response, name: str, default=None) -> np.ndarray | None:
    tensor = response.outputs.get(name)
    return default if tensor is None else np.from_dlpack(tensor)
