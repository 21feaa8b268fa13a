"""Follows tensorrt_llm/llmapi/llm.py: LLM(model, tokenizer=None, ..., **kwargs) whose keyword
arguments are LlmArgs fields (nested configs may be dicts); generate_async(inputs, sampling_params,
lora_request, ..., streaming) returns a RequestOutput at once, iterated asynchronously."""
from __future__ import annotations

import asyncio
import itertools

from tensorrt_llm.executor import GenerationResult, RequestError

from app.engine import SamplingParams as EngineParams
from app.engine.outputs import CompletionOutput as EngineCompletion
from app.engine.outputs import RequestOutput as EngineOutput
from tests.fakes._engine import start_engine

RequestOutput = GenerationResult

# LlmArgs fields this fake understands; LlmArgs (pydantic, extra="forbid") refuses unknown ones.
LLM_ARGS = {"pipeline_parallel_size", "max_batch_size", "max_num_tokens", "max_seq_len", "max_beam_width",
            "enable_chunked_prefill", "kv_cache_config", "scheduler_config", "cuda_graph_config",
            "speculative_config", "enable_lora", "lora_config", "backend", "orchestrator_type",
            "disable_overlap_scheduler", "guided_decoding_backend", "gather_generation_logits"}


class LLM:
    def __init__(self, model, tokenizer=None, tokenizer_mode="auto", skip_tokenizer_init=False,
                 trust_remote_code=False, tensor_parallel_size=1, dtype="auto", revision=None,
                 tokenizer_revision=None, **kwargs):
        unknown = set(kwargs) - LLM_ARGS
        if unknown:
            raise ValueError(f"Extra inputs are not permitted: {sorted(unknown)}")
        guided = kwargs.get("guided_decoding_backend")
        if guided not in (None, "xgrammar", "llguidance"):
            raise ValueError(f"Unsupported guided decoding backend {guided}")
        if guided is not None and skip_tokenizer_init:
            # The executor's guided decoding config is built from the tokenizer's vocabulary
            # (_xgrammar_tokenizer_info(self.tokenizer)); a skipped tokenizer is None.
            raise AttributeError("'NoneType' object has no attribute 'eos_token_id'")
        self.args = {"model": model, "skip_tokenizer_init": skip_tokenizer_init,
                     "trust_remote_code": trust_remote_code, "tensor_parallel_size": tensor_parallel_size,
                     "dtype": dtype, **kwargs}
        self.skip_tokenizer_init = skip_tokenizer_init
        self.max_batch_size = kwargs.get("max_batch_size", 2048)
        kv = kwargs.get("kv_cache_config") or {}
        lora = kwargs.get("lora_config") or {}
        policy = (kwargs.get("scheduler_config") or {}).get("capacity_scheduler_policy", "GUARANTEED_NO_EVICT")
        self._engine = start_engine(str(model), self.max_batch_size, kwargs.get("max_num_tokens", 8192),
                                    kwargs.get("max_seq_len"), kwargs.get("max_beam_width", 1),
                                    kv.get("enable_block_reuse", True), kv.get("tokens_per_block", 32),
                                    kv.get("max_tokens"), policy, lora.get("max_loras", 8),
                                    lora.get("max_cpu_loras", 64), lora.get("max_lora_rank", 64),
                                    kwargs.get("enable_chunked_prefill", False))
        self._ids = itertools.count(1)
        self._loras: dict[int, str] = {}
        self.requests: list[dict] = []  # what each generate_async call received, for contract tests
        self.aborted: list[int] = []

    def generate_async(self, inputs, sampling_params=None, lora_request=None, prompt_adapter_request=None,
                       streaming=False, queries=None, kv_cache_retention_config=None, disaggregated_params=None,
                       _postproc_params=None) -> GenerationResult:
        if isinstance(inputs, dict):
            inputs = inputs["prompt_token_ids"]
        if isinstance(inputs, str):
            raise TypeError("text inputs need the tokenizer, which skip_tokenizer_init disabled")
        sp = sampling_params
        if self.skip_tokenizer_init and sp.end_id is None:
            raise ValueError("end_id is required when the tokenizer is skipped")
        if sp.n > self.max_batch_size:
            raise ValueError(f"SamplingParams.n ({sp.n}) should not exceed max_batch_size ({self.max_batch_size})")
        self.requests.append({"inputs": list(inputs), "sampling_params": sp, "lora_request": lora_request,
                              "streaming": streaming})
        result = GenerationResult(next(self._ids), list(inputs), sp, streaming, self)
        result.task = asyncio.get_running_loop().create_task(self._run(result, lora_request))
        return result

    async def _run(self, result: GenerationResult, lora_request) -> None:
        try:
            adapter = None
            if lora_request is not None:
                adapter = str(lora_request.lora_int_id)
                if self._loras.get(lora_request.lora_int_id) != lora_request.lora_path:
                    await self._engine.add_lora(adapter, lora_request.lora_path)
                    self._loras[lora_request.lora_int_id] = lora_request.lora_path
            async for item in self._engine.generate(str(result.request_id), result.prompt_token_ids,
                                                    engine_params(result.sampling_params), adapter):
                result._queue.put_nowait(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the executor reports failures on the result
            result._queue.put_nowait(RequestError(str(exc)))

    def abort_request(self, result: GenerationResult) -> None:
        self.aborted.append(result.request_id)
        if result.task is not None and not result.task.done():
            result.task.cancel()
            result._queue.put_nowait(EngineOutput(str(result.request_id), [
                EngineCompletion(i, [], None, 0.0, "abort") for i in range(result.sampling_params.n)], True))

    def shutdown(self) -> None:
        self._engine.shutdown()


def engine_params(sp) -> EngineParams:
    """TensorRT-LLM SamplingParams as the portable engine's (None: the C++ runtime's default)."""
    beam = sp.use_beam_search
    return EngineParams(
        max_tokens=sp.max_tokens, end_id=sp.end_id, pad_id=sp.pad_id,
        temperature=1.0 if sp.temperature is None else sp.temperature, top_k=sp.top_k or 0,
        top_p=1.0 if sp.top_p is None else sp.top_p, min_p=sp.min_p or 0.0, seed=sp.seed,
        repetition_penalty=sp.repetition_penalty or 1.0, presence_penalty=sp.presence_penalty or 0.0,
        frequency_penalty=sp.frequency_penalty or 0.0, min_tokens=sp.min_tokens or 0,
        stop_token_ids=[[t] for t in sp.stop_token_ids or []], bad_token_ids=[[t] for t in sp.bad_token_ids or []],
        ignore_eos=sp.ignore_eos, logprobs=bool(sp.logprobs), n=sp.n, beam_width=sp.best_of if beam else 1,
        length_penalty=sp.length_penalty if sp.length_penalty is not None else 1.0,
        return_context_logits=sp.return_context_logits, return_generation_logits=sp.return_generation_logits,
        logit_bias=_bias(sp.embedding_bias))


def _bias(embedding_bias) -> dict[int, float]:
    """The embedding bias (added to the logits) as the portable engine's logit_bias."""
    if embedding_bias is None:
        return {}
    return {int(i): float(embedding_bias[i]) for i in embedding_bias.nonzero().flatten().tolist()}
