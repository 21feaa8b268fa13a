"""Follows tensorrt_llm/executor/request.py (LoRARequest) and executor/result.py (CompletionOutput,
GenerationResult: async iteration of cumulative outputs, abort()); perf metrics follow the
bindings' RequestPerfMetrics (timing_metrics as timedeltas, kv_cache_metrics counts). Logits follow
result.py and the PyTorch backend's LlmResult: GenerationResult.context_logits [prompt tokens, vocab]
once the context phase is done; CompletionOutput.generation_logits [tokens, vocab], streaming the
latest response's rows only (LlmResult keeps all rows only when not streaming)."""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal, Optional, Union

import torch


class RequestError(RuntimeError):
    """Follows tensorrt_llm.executor.utils.RequestError: a request the executor failed."""


@dataclass(slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if self.lora_path is not None and not os.path.exists(self.lora_path):
            raise ValueError(f"lora_path ({self.lora_path}) does not exist.")

    @property
    def adapter_id(self):
        return self.lora_int_id

    @property
    def name(self):
        return self.lora_name

    @property
    def path(self):
        return self.lora_path


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: Optional[int] = None


@dataclass
class TimingMetrics:
    arrival_time: timedelta
    first_scheduled_time: timedelta
    first_token_time: timedelta
    last_token_time: timedelta


@dataclass
class KvCacheMetrics:
    num_total_allocated_blocks: int
    num_new_allocated_blocks: int
    num_reused_blocks: int
    num_missed_blocks: int
    kv_cache_hit_rate: float


@dataclass
class RequestPerfMetrics:
    timing_metrics: TimingMetrics
    kv_cache_metrics: KvCacheMetrics


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: Optional[list[int]] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list] = field(default_factory=list)
    prompt_logprobs: Optional[list] = field(default_factory=list)
    finish_reason: Optional[Literal["stop", "length", "timeout", "cancelled"]] = None
    stop_reason: Optional[Union[int, str]] = None
    generation_logits: Optional[torch.Tensor] = None
    request_perf_metrics: Optional[RequestPerfMetrics] = None
    _last_token_ids_len: int = field(default=0, init=False, repr=False)
    _last_logprobs_len: int = field(default=0, init=False, repr=False)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len:]

    @property
    def logprobs_diff(self) -> list:
        return self.logprobs[self._last_logprobs_len:]


class GenerationResult:
    """What generate_async returns: iterate it (async) for cumulative outputs; abort() cancels."""

    def __init__(self, request_id: int, prompt_token_ids: list[int], sampling_params, streaming: bool, executor):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self._streaming = streaming
        self._executor = executor
        self._outputs = [CompletionOutput(i) for i in range(sampling_params.best_of)]
        self._context_logits: Optional[torch.Tensor] = None
        self._queue: asyncio.Queue = asyncio.Queue()  # (engine RequestOutput | BaseException)
        self._done = False
        self._aborted = False
        self.task: asyncio.Task | None = None

    @property
    def outputs(self) -> list[CompletionOutput]:
        return self._outputs[:self.sampling_params.n]

    @property
    def context_logits(self) -> Optional[torch.Tensor]:
        return self._context_logits

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self._executor.abort_request(self)
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            self._handle(item)
            if self._streaming or self._done:
                return self

    async def aresult(self):
        while not self._done:
            await self.__anext__()
        return self

    def _handle(self, item) -> None:
        for out in self._outputs:
            out._last_token_ids_len, out._last_logprobs_len = len(out.token_ids), len(out.logprobs)
        for c in item.outputs:
            out = self._outputs[c.index]
            out.token_ids = out.token_ids + list(c.token_ids)
            if c.logprobs is not None and self.sampling_params.logprobs:
                out.logprobs = out.logprobs + [{t: Logprob(p, 1)} for t, p in zip(c.token_ids, c.logprobs)]
            out.cumulative_logprob = c.cumulative_logprob
            if c.generation_logits is not None and self.sampling_params.return_generation_logits:
                rows = torch.from_numpy(c.generation_logits)
                keep = out.generation_logits is not None and not self._streaming
                out.generation_logits = torch.cat([out.generation_logits, rows]) if keep else rows
            if c.finish_reason is not None:
                out.finish_reason = {"abort": "cancelled"}.get(c.finish_reason, c.finish_reason)
                reason = c.stop_reason
                out.stop_reason = reason[0] if isinstance(reason, list) and len(reason) == 1 else reason
        if item.context_logits is not None and self.sampling_params.return_context_logits:
            self._context_logits = torch.from_numpy(item.context_logits)
        self._done = item.finished
        if item.finished and item.metrics is not None and self.sampling_params.return_perf_metrics:
            m = item.metrics
            since = lambda ns: timedelta(microseconds=ns // 1000)  # noqa: E731
            perf = RequestPerfMetrics(
                TimingMetrics(since(m.arrival_time_ns), since(m.first_scheduled_time_ns),
                              since(m.first_token_time_ns), since(m.last_token_time_ns)),
                KvCacheMetrics(m.kv_cache_alloc_total_blocks, m.kv_cache_alloc_new_blocks, m.kv_cache_reused_blocks,
                               m.kv_cache_alloc_new_blocks, m.kv_cache_hit_rate))
            for out in self._outputs:
                out.request_perf_metrics = perf
