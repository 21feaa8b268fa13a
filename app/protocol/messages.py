"""What travels between the DAG's stages: front-end neutral, picklable, small."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from app.engine.errors import InvalidRequestError
from app.engine.outputs import RequestMetrics, concat_rows
from app.engine.sampling_params import SamplingParams


@dataclass
class AdapterRef:
    """A LoRA adapter named by a request: its name, and the path to load it from on first use."""

    name: str
    path: str | None = None
    field: str = "lora_task_id"  # how the request named it, for error messages


@dataclass
class GenerationJob:
    """A request as the ingress understood it: text, chat messages or token ids, plus parameters."""

    request_id: str
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None  # functions for the chat template, {"type": "function", "function": {...}}
    stop: list[str] = field(default_factory=list)  # stop strings, matched on text
    bad_words: list[str] = field(default_factory=list)
    adapter: AdapterRef | None = None
    api: str = "triton"  # the front end that took it: "triton" or "openai" (a metrics label)
    echo: bool = False  # /v1/completions: the answer shows the prompt before the completion


# Adapter names route requests (Serve's multiplexed model id travels in ASCII metadata) and key
# caches; printable ASCII without spaces keeps them safe everywhere they go.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,127}")


def check_job(job: GenerationJob, max_stop_words: int, max_stop_word_len: int) -> None:
    """What the ingress refuses before any stage runs, on every route: too many or too long stop
    and bad words (each word is tokenized, held back while streaming and matched at every step),
    and adapter names that could not travel as routing keys."""
    stop_field = "stop" if job.api == "openai" else "stop_words"
    for name, words, ids_name, ids in ((stop_field, job.stop, "stop_token_ids", job.params.stop_token_ids),
                                       ("bad_words", job.bad_words, "bad_token_ids", job.params.bad_token_ids)):
        if len(words) + len(ids) > max_stop_words:
            raise InvalidRequestError(name if words else ids_name, f"{len(words) + len(ids)} words exceed this "
                                                                   f"server's max_stop_words of {max_stop_words}")
        longest = max(map(len, words), default=0)
        if longest > max_stop_word_len:
            raise InvalidRequestError(name, f"a word of {longest} characters exceeds this server's "
                                            f"max_stop_word_len of {max_stop_word_len}")
    if job.adapter is not None and not ADAPTER_NAME.fullmatch(job.adapter.name):
        raise InvalidRequestError(job.adapter.field, "an adapter name is 1-128 characters of letters, digits and "
                                                     "._:@/+- (starting with a letter or digit)")


@dataclass
class TokenizedJob:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # stop/bad words now as token-id sequences too
    stop: list[str]
    adapter: AdapterRef | None = None
    echo: str | None = None  # the prompt's text, for jobs whose answer shows it (the detokenizer sends it on)


def tokenized_as_sent(job: GenerationJob) -> TokenizedJob | None:
    """The job as the engine takes it, where the Tokenizer has nothing to do for it: token ids, no
    stop or bad words as text, no prompt text to echo. None where the Tokenizer is needed. The
    Ingress sends such a job on without a Tokenizer call: one Serve hop less on the way in
    (docs/PERFORMANCE.md, "Token ids skip the Tokenizer")."""
    if job.prompt_token_ids is None or job.messages is not None or job.stop or job.bad_words or job.echo:
        return None
    return TokenizedJob(job.request_id, job.prompt_token_ids, job.params, [], job.adapter)


@dataclass
class TokenText:
    """An output token as OpenAI's logprobs show it (Tokenizer.token_piece): its text and bytes,
    where it starts (characters of the output's token texts before it: text_offset), and the
    likeliest tokens at its position as (text, bytes, logprob), best first."""

    text: str
    bytes: bytes
    offset: int
    top: list[tuple[str, bytes, float]]


@dataclass
class TextOutput:
    index: int
    text: str  # the new text since the previous chunk
    token_ids: list[int]
    logprobs: list[float] | None
    cumulative_logprob: float
    finish_reason: str | None = None
    stop_reason: int | str | list[int] | None = None
    tokens: list[TokenText] | None = None  # with logprobs: one per token id
    generation_logits: np.ndarray | None = None  # return_generation_logits: float32 [token ids, vocab]


@dataclass
class PromptText:
    """The prompt as an echo shows it: its text, and where prompt logprobs were asked each token
    (offsets from the prompt's start) with its logprob, None for the first (nothing comes before it)."""

    text: str
    tokens: list[TokenText] | None = None
    logprobs: list[float | None] | None = None


@dataclass
class TextChunk:
    """The detokenizer's stream item: new text of each output, and at the end the metrics. The
    first chunk of a job that echoes carries the prompt."""

    outputs: list[TextOutput]
    finished: bool
    num_prompt_tokens: int
    metrics: RequestMetrics | None = None
    prompt: PromptText | None = None
    context_logits: np.ndarray | None = None  # return_context_logits, first chunk: float32 [prompt tokens, vocab]


def merge_chunks(a: TextChunk, b: TextChunk) -> TextChunk:
    by_index = {o.index: TextOutput(**vars(o)) for o in a.outputs}
    for o in b.outputs:
        prev = by_index.get(o.index)
        if prev is None:
            by_index[o.index] = TextOutput(**vars(o))
            continue
        prev.text += o.text
        prev.token_ids = prev.token_ids + o.token_ids
        if o.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + o.logprobs
        if o.tokens is not None:
            prev.tokens = (prev.tokens or []) + o.tokens
        prev.generation_logits = concat_rows(prev.generation_logits, o.generation_logits)
        prev.cumulative_logprob = o.cumulative_logprob
        prev.finish_reason, prev.stop_reason = o.finish_reason, o.stop_reason
    return TextChunk([by_index[i] for i in sorted(by_index)], b.finished, b.num_prompt_tokens, b.metrics or a.metrics,
                     a.prompt or b.prompt, a.context_logits if a.context_logits is not None else b.context_logits)
