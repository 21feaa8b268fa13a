"""What the engine hands back: per-step deltas of each request, and its metrics at the end."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end id or a stop sequence
    LENGTH = "length"  # max_tokens
    ABORT = "abort"


@dataclass
class CompletionOutput:
    """New tokens of one of a request's outputs since the previous RequestOutput."""

    index: int
    token_ids: list[int]
    logprobs: list[float] | None
    cumulative_logprob: float
    finish_reason: str | None = None
    stop_reason: int | list[int] | None = None
    # Requests with top_logprobs: per token, (ids, logprobs) of the likeliest tokens at its position
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    # Requests with return_generation_logits: float32 [tokens, vocab], the raw logits of each new
    # token's position (a numpy array pickles as its raw bytes: no Python float per value)
    generation_logits: np.ndarray | None = None


@dataclass
class RequestMetrics:
    """TensorRT-LLM's per-request perf metrics (times are wall-clock ns)."""

    arrival_time_ns: int
    first_scheduled_time_ns: int
    first_token_time_ns: int
    last_token_time_ns: int
    num_prompt_tokens: int
    num_output_tokens: int
    kv_cache_reused_blocks: int
    kv_cache_alloc_new_blocks: int
    num_preemptions: int = 0
    total_draft_tokens: int = 0  # speculation: tokens guessed, and those the model confirmed
    total_accepted_draft_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.total_accepted_draft_tokens / self.total_draft_tokens if self.total_draft_tokens else 0.0

    @property
    def kv_cache_alloc_total_blocks(self) -> int:
        return self.kv_cache_reused_blocks + self.kv_cache_alloc_new_blocks

    @property
    def kv_cache_hit_rate(self) -> float:
        total = self.kv_cache_alloc_total_blocks
        return self.kv_cache_reused_blocks / total if total else 0.0


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None  # set on the final output
    # Requests with prompt_logprobs, on their first output: per prompt token its logprob given those
    # before it (None for the first, which has no context), and with prompt_logprobs > 0 the
    # (ids, logprobs) of the likeliest tokens at its position (None for the first).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[tuple[list[int], list[float]] | None] | None = None
    # Requests with return_context_logits, on their first output: float32 [prompt tokens, vocab]
    context_logits: np.ndarray | None = None
    # Set when the request failed inside the engine: an InvalidRequestError where it was the request's
    # fault (a guide that did not compile), else a sentence.
    error: str | Exception | None = None


# A plain delta as it crosses a process boundary (the engine's own process to its replica): one
# output and none of the extras (logprobs, logits, metrics, an error) travels as a tuple. Writing a
# step of 256 requests' deltas into the pipe took the engine loop's thread 1.1-1.3 ms as
# RequestOutputs and 0.3 ms as tuples on the 2-core dev box (python -m tools.bench.pipe_cost).
# Anything else goes whole. The fields _pack looks at (a test keeps them equal to the dataclasses' own):
_KNOWN_REQUEST_FIELDS = {"request_id", "outputs", "finished", "metrics", "prompt_logprobs",
                         "prompt_top_logprobs", "context_logits", "error"}
_KNOWN_OUTPUT_FIELDS = {"index", "token_ids", "logprobs", "cumulative_logprob", "finish_reason", "stop_reason",
                        "top_logprobs", "generation_logits"}


def pack_outputs(outputs: list[RequestOutput]) -> list:
    """A step's outputs for the wire: plain ones as tuples, the rest as they are (unpack_outputs)."""
    return [_pack(out) for out in outputs]


def _pack(out: RequestOutput):
    if (len(out.outputs) == 1 and out.metrics is None and out.error is None and out.prompt_logprobs is None
            and out.prompt_top_logprobs is None and out.context_logits is None):
        c = out.outputs[0]
        if c.logprobs is None and c.top_logprobs is None and c.generation_logits is None:
            return out.request_id, out.finished, c.index, c.token_ids, c.cumulative_logprob, c.finish_reason, \
                c.stop_reason
    return out


def unpack_outputs(packed: list) -> list[RequestOutput]:
    """pack_outputs' list back as RequestOutputs, equal to those packed."""
    return [_unpack(*p) if type(p) is tuple else p for p in packed]


def _unpack(request_id, finished, index, token_ids, cumulative_logprob, finish_reason, stop_reason) -> RequestOutput:
    output = CompletionOutput(index=index, token_ids=token_ids, logprobs=None, cumulative_logprob=cumulative_logprob,
                              finish_reason=finish_reason, stop_reason=stop_reason)
    return RequestOutput(request_id=request_id, outputs=[output], finished=finished)


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    num_preempted_total: int
    max_batch_size: int
    max_num_tokens: int
    tokens_per_block: int
    max_blocks: int
    free_blocks: int
    used_blocks: int
    reused_blocks_total: int
    new_blocks_total: int
    steps: int
    context_tokens_last_step: int
    generation_requests_last_step: int
    context_requests_last_step: int = 0
    num_paused: int = 0  # preempted sequences waiting to be resumed
    lora: dict = field(default_factory=dict)  # adapters held (host, device) and the device cache's counters

    @property
    def kv_cache_hit_rate(self) -> float:
        total = self.reused_blocks_total + self.new_blocks_total
        return self.reused_blocks_total / total if total else 0.0


def concat_rows(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    """Two deltas' logits rows as one array (either may be None: no rows)."""
    if a is None or b is None:
        return a if b is None else b
    return np.concatenate([a, b])


def merge_outputs(acc: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold a streamed delta into the accumulated output of the same request."""
    if acc is None:
        acc = RequestOutput(delta.request_id, [], False)
    by_index = {c.index: c for c in acc.outputs}
    for c in delta.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            by_index[c.index] = CompletionOutput(c.index, list(c.token_ids), list(c.logprobs) if c.logprobs is not None else None,
                                                 c.cumulative_logprob, c.finish_reason, c.stop_reason,
                                                 list(c.top_logprobs) if c.top_logprobs is not None else None,
                                                 c.generation_logits)
            continue
        prev.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + list(c.logprobs)
        if c.top_logprobs is not None:
            prev.top_logprobs = (prev.top_logprobs or []) + list(c.top_logprobs)
        prev.generation_logits = concat_rows(prev.generation_logits, c.generation_logits)
        prev.cumulative_logprob = c.cumulative_logprob
        prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
    acc.outputs = [by_index[i] for i in sorted(by_index)]
    acc.finished = delta.finished
    acc.metrics = delta.metrics or acc.metrics
    acc.prompt_logprobs = acc.prompt_logprobs or delta.prompt_logprobs
    acc.prompt_top_logprobs = acc.prompt_top_logprobs or delta.prompt_top_logprobs
    acc.context_logits = acc.context_logits if acc.context_logits is not None else delta.context_logits
    acc.error = acc.error or delta.error
    return acc
