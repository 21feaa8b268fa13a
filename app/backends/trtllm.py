"""TensorRT-LLM's LLM API behind the engine protocol.

Written against the public API of tensorrt_llm (LLM, SamplingParams, GuidedDecodingParams,
LoRARequest, the RequestOutput of generate_async); it is tested here against a fake that follows
those signatures (tests/fakes/tensorrt_llm), never against the real package, which cannot be
installed on our machines. The config's engine keys go to tensorrt_llm.LLM(...) as the seeds'
model.yaml does.
"""
from __future__ import annotations

import importlib
import json
from datetime import timedelta

import torch  # TensorRT-LLM's own dependency: its SamplingParams takes tensors

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
from app.config import ServiceConfig
from app.engine.errors import BackendError, InvalidRequestError
from app.engine.guided import Guide
from app.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from app.engine.sampling_params import SamplingParams, validate_request
from app.protocol.messages import AdapterRef

FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "timeout": "abort"}
GUIDE_FIELDS = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}  # our kind -> GuidedDecodingParams field


def guided_decoding_params(guide: Guide, params_cls) -> object:
    """Our guide as TensorRT-LLM's GuidedDecodingParams (one field set)."""
    if guide.kind == "json":
        return params_cls(json=OBJECT_SCHEMA)
    if guide.kind == "structural_tag":
        return params_cls(structural_tag=structural_tag(guide.spec))
    return params_cls(**{GUIDE_FIELDS[guide.kind]: guide.spec})


def structural_tag(spec: str) -> str:
    """Our structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}, checked
    already) as the JSON TensorRT-LLM hands to xgrammar's compile_structural_tag since its move to
    XGrammar 0.1.25: triggered tags, each holding its structure's JSON schema between begin and end."""
    tag = json.loads(spec)
    tags = [{"begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]}, "end": s["end"]}
            for s in tag["structures"]]
    return json.dumps({"type": "structural_tag",
                       "format": {"type": "triggered_tags", "triggers": tag["triggers"], "tags": tags}})


def llm_kwargs(config: ServiceConfig, model_dir: str) -> dict:
    """tensorrt_llm.LLM keyword arguments from our config, nested sections as dicts (what the seeds'
    llmapi model does with model.yaml; LLM's pydantic arguments validate them)."""
    kv = config.kv_cache_config
    kwargs = {
        "model": model_dir, "tensor_parallel_size": config.tensor_parallel_size,
        "pipeline_parallel_size": config.pipeline_parallel_size, "dtype": config.dtype,
        "max_batch_size": config.max_batch_size, "max_num_tokens": config.max_num_tokens,
        "max_beam_width": config.max_beam_width, "enable_chunked_prefill": config.enable_chunked_prefill,
        "trust_remote_code": config.trust_remote_code,
        # Guided decoding is chosen when the LLM is built, not per request. Its xgrammar backend
        # reads the vocabulary from the LLM's tokenizer, so the tokenizer is loaded (no
        # skip_tokenizer_init), though our tokenizer stage owns text: ids in, ids out.
        "guided_decoding_backend": "xgrammar",
        "kv_cache_config": {"enable_block_reuse": kv.enable_block_reuse, "tokens_per_block": kv.tokens_per_block,
                            "free_gpu_memory_fraction": kv.free_gpu_memory_fraction, "max_tokens": kv.max_tokens,
                            "dtype": kv.dtype},
        "scheduler_config": {"capacity_scheduler_policy": config.scheduler_policy.value},
        "enable_lora": True,
        "lora_config": {"max_lora_rank": config.max_lora_rank, "max_loras": config.max_loras,
                        "max_cpu_loras": config.max_cpu_loras},
    }
    if config.max_seq_len is not None:
        kwargs["max_seq_len"] = config.max_seq_len
    if config.cuda_graph_config is not None:
        kwargs["cuda_graph_config"] = config.cuda_graph_config
    if config.disable_overlap_scheduler:  # the PyTorch backend's argument of the same name
        kwargs["disable_overlap_scheduler"] = True
    if config.speculative_config is not None:
        kwargs["speculative_config"] = config.speculative_config
    if config.max_logits_floats > 0:
        # return_generation_logits needs the LLM built to gather them (an LlmArgs field); context
        # logits need nothing more on the PyTorch workflow (a TensorRT engine must have been built
        # with BuildConfig.gather_context_logits, which we do not set).
        kwargs["gather_generation_logits"] = True
    if config.world_size > 1:
        # TensorRT-LLM's Ray orchestrator starts one worker actor per rank; inside a Serve replica
        # they land in the replica's placement group (config.engine_deployment_options).
        kwargs["orchestrator_type"] = "ray"
    return {**kwargs, **config.llm_args}


class TrtllmBackend:
    name = "trtllm"

    def __init__(self, config: ServiceConfig, adapters: dict[str, str]):
        self.trtllm = import_backend_package("tensorrt_llm", "tensorrt_llm")
        self.served = ServedModel(config)
        self.eos_ids = self.served.eos_ids
        self.lora_request_cls = importlib.import_module("tensorrt_llm.executor").LoRARequest
        self.guided_params_cls = importlib.import_module("tensorrt_llm.sampling_params").GuidedDecodingParams
        kwargs = llm_kwargs(config, str(self.served.dir))
        self.guided_backend = kwargs.get("guided_decoding_backend")  # llm_args may have replaced ours
        self.llm = self.trtllm.LLM(**kwargs)
        self.adapters = AdapterTable()
        for name, path in adapters.items():  # TensorRT-LLM reads the weights from the path on first use
            self.adapters.register(name, path)
        self.in_flight = 0
        self.closed = False

    async def add_lora(self, name: str, path: str) -> None:
        self.adapters.register(name, path)

    def sampling_params(self, params: SamplingParams) -> object:
        """Our parameters as tensorrt_llm.SamplingParams (field names from its public dataclass)."""
        single = lambda seqs: [s[0] for s in seqs if len(s) == 1]  # noqa: E731
        guided = self.guided_decoding(params.guide) if params.guide is not None else None
        refuse_torch_only(params, "trtllm")
        if any(len(s) > 1 for s in params.bad_token_ids):
            raise InvalidRequestError("bad_words", "the trtllm backend bans single tokens only; every bad word "
                                                   "must be one token")
        end_id, extra_eos = self.served.end_ids(params)
        beam = params.beam_width > 1
        # Greedy is top_k 1 to TensorRT-LLM (temperature 0 is refused by some of its versions).
        temperature, top_k = (None, 1) if params.greedy else (params.temperature, params.top_k or None)
        return self.trtllm.SamplingParams(
            max_tokens=params.max_tokens, end_id=end_id, pad_id=params.pad_id if params.pad_id is not None else end_id,
            temperature=temperature, top_k=top_k, top_p=params.top_p, min_p=params.min_p or None, seed=params.seed,
            repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            min_tokens=params.min_tokens or None, stop_token_ids=single(params.stop_token_ids) + extra_eos or None,
            bad_token_ids=single(params.bad_token_ids) or None, ignore_eos=params.ignore_eos,
            logprobs=1 if params.logprobs else None, n=params.n, best_of=params.beam_width if beam else None,
            use_beam_search=beam, length_penalty=params.length_penalty if beam else None,
            guided_decoding=guided, detokenize=False, return_perf_metrics=True,
            return_context_logits=params.return_context_logits,
            return_generation_logits=params.return_generation_logits, embedding_bias=self._bias(params))

    def _bias(self, params: SamplingParams):
        """logit_bias as SamplingParams.embedding_bias: a float32 tensor [vocab_size], or None."""
        if not params.logit_bias:
            return None
        return torch.from_numpy(bias_row(params.logit_bias, self.served.limits.vocab_size))

    def guided_decoding(self, guide: Guide) -> object:
        """The request's GuidedDecodingParams, its guide checked first (400 if it does not parse)."""
        if self.guided_backend != "xgrammar":
            raise InvalidRequestError(guide.field, "guided decoding needs the LLM built with guided_decoding_backend: "
                                                   "xgrammar (this config's llm_args set another)")
        self.served.check_guide(guide)
        return guided_decoding_params(guide, self.guided_params_cls)

    def lora_request(self, adapter: AdapterRef | None) -> object | None:
        if adapter is None:
            return None
        adapter_id, path = self.adapters.resolve(adapter)
        try:
            return self.lora_request_cls(adapter.name, adapter_id, path)
        except ValueError as exc:  # LoRARequest checks that the path exists
            raise InvalidRequestError(adapter.field, str(exc)) from None

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       adapter: AdapterRef | None = None):
        params = validate_request(prompt_token_ids, params, self.served.limits)
        sampling, lora = self.sampling_params(params), self.lora_request(adapter)
        try:
            result = self.llm.generate_async(prompt_token_ids, sampling_params=sampling, lora_request=lora,
                                             streaming=True)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError("request", f"TensorRT-LLM refused it: {exc}") from None
        self.in_flight += 1
        multi_token = [s for s in params.stop_token_ids if len(s) > 1]  # single ids stop natively
        watchers = [StopWatcher(multi_token, params.min_tokens) for _ in range(params.n)]
        finished, context_due = False, params.return_context_logits
        try:
            async for output in self._iterate(result):
                delta, stopped = self._delta(request_id, output, watchers, params, len(prompt_token_ids))
                if context_due and output.context_logits is not None:  # on the first delta that has them
                    delta.context_logits, context_due = self._context_rows(output, len(prompt_token_ids)), False
                if stopped:
                    result.abort()  # a multi-token stop sequence ended it: the executor frees the request
                finished = delta.finished
                yield delta
                if finished:
                    return
        finally:
            self.in_flight -= 1
            if not finished:
                result.abort()

    async def _iterate(self, result):
        try:
            async for output in result:
                yield output
        except Exception as exc:  # noqa: BLE001 - the executor's own error, passed on in its words
            raise BackendError(self.name, str(exc)) from None

    def _delta(self, request_id: str, output, watchers: list[StopWatcher], params: SamplingParams,
               num_prompt: int) -> tuple[RequestOutput, bool]:
        """Our delta from TensorRT-LLM's cumulative RequestOutput, and whether a stop sequence
        ended the request here (so the executor must be told to stop)."""
        beam = params.beam_width > 1
        completions = []
        for out in output.outputs:
            if beam and not output.finished:
                continue  # beams are rewritten as they go: sent whole at the end, as the portable engine does
            new = list(out.token_ids if beam else out.token_ids_diff)
            logprobs = self._logprobs(out, new, beam) if params.logprobs else None
            rows = self._generation_rows(out, len(new)) if params.return_generation_logits else None
            finish, stop_reason = FINISH_REASONS.get(out.finish_reason), out.stop_reason
            if not beam:
                watcher = watchers[out.index]
                if watcher.matched is not None:
                    continue  # this output already ended on a stop sequence
                new, logprobs, rows, matched = watcher.push(new, logprobs, final=finish is not None, logits=rows)
                if matched is not None:
                    finish, stop_reason = "stop", matched
            completions.append(CompletionOutput(out.index, new, logprobs, out.cumulative_logprob or 0.0,
                                                finish, stop_reason, generation_logits=rows))
        stopped = not beam and all(w.matched is not None for w in watchers)
        done = output.finished or stopped
        metrics = self._metrics(output, num_prompt) if done else None
        return RequestOutput(request_id, completions, done, metrics), stopped and not output.finished

    def _context_rows(self, output, num_prompt: int):
        """GenerationResult.context_logits, [prompt tokens, vocab]; fewer rows (a cached prefix may
        get none) fail the request rather than go out short."""
        return context_rows(output.context_logits, num_prompt, self.served.limits.vocab_size, self.name)

    def _generation_rows(self, out, num_new: int):
        """The new tokens' generation logits. Streaming, the LLM API's CompletionOutput.generation_logits
        holds the latest response's rows, [tokens, vocab] (the PyTorch backend's
        LlmResult.generation_logits keeps only the last chunk when streaming); rows past the tokens
        (an end id or stop word cut from token_ids) are dropped."""
        # No new tokens: no rows, but tokens held for a stop sequence may still go out with theirs.
        return generation_rows(out.generation_logits if num_new else None, num_new, self.served.limits.vocab_size,
                               self.name, "is the LLM built with gather_generation_logits?")

    @staticmethod
    def _logprobs(out, new: list[int], beam: bool) -> list[float]:
        """Per-token logprobs of the chosen tokens: floats (TensorRT backend) or top-k dicts of
        token id -> Logprob (PyTorch backend)."""
        recent = out.logprobs if beam else out.logprobs_diff
        values = []
        for token, entry in zip(new, recent):
            values.append(entry[token].logprob if isinstance(entry, dict) else float(entry))
        return values

    @staticmethod
    def _metrics(output, num_prompt: int) -> RequestMetrics | None:
        first = output.outputs[0] if output.outputs else None
        perf = getattr(first, "request_perf_metrics", None)
        if perf is None:
            return None
        timing, kv = perf.timing_metrics, perf.kv_cache_metrics
        speculation = getattr(perf, "speculative_decoding", None)  # RequestPerfMetrics.SpeculativeDecodingMetrics
        ns = lambda t: int(t / timedelta(microseconds=1)) * 1000 if isinstance(t, timedelta) else int(t)  # noqa: E731
        return RequestMetrics(
            arrival_time_ns=ns(timing.arrival_time), first_scheduled_time_ns=ns(timing.first_scheduled_time),
            first_token_time_ns=ns(timing.first_token_time), last_token_time_ns=ns(timing.last_token_time),
            num_prompt_tokens=num_prompt, num_output_tokens=sum(len(o.token_ids) for o in output.outputs),
            kv_cache_reused_blocks=kv.num_reused_blocks, kv_cache_alloc_new_blocks=kv.num_new_allocated_blocks,
            total_draft_tokens=getattr(speculation, "total_draft_tokens", 0),
            total_accepted_draft_tokens=getattr(speculation, "total_accepted_draft_tokens", 0))

    def stats(self) -> dict:
        return {"backend": self.name, "healthy": self.healthy, "num_running": self.in_flight,
                "lora": {"host": list(self.adapters.paths), "device": []}}

    @property
    def healthy(self) -> bool:
        # The LLM API has no health query; an executor that fails says so on each request instead
        # (BackendError), so this reports only whether the LLM is still up.
        return not self.closed

    def shutdown(self) -> None:
        self.closed = True
        self.llm.shutdown()
