"""Per-request generation parameters and their validation against the engine's limits."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from app.engine.config import EngineConfig
from app.engine.errors import InvalidRequestError
from app.engine.guided import Guide

# Below this a temperature divides logits into infinities and NaNs; it means greedy (vLLM's rule).
MIN_SAMPLING_TEMPERATURE = 1e-5
SEED_LIMIT = 1 << 64  # torch generators take unsigned 64-bit seeds
MAX_GUIDE_CHARS = 1 << 16  # a schema, regex or grammar; compiling one holds up the engine's loop
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_LENGTH_PENALTY = 10.0
MAX_LOGIT_BIAS = 300  # logit_bias entries per request (OpenAI's limit)
LOGIT_BIAS_RANGE = 100.0  # each bias lies in [-100, 100] (OpenAI's range)


@dataclass
class SamplingParams:
    """Token-level parameters of one request (TensorRT-LLM SamplingParams semantics, ids not text).

    temperature 0 (or below MIN_SAMPLING_TEMPERATURE, or top_k 1) means greedy. Stop and bad words are token-id sequences; a stop
    sequence ends generation and is cut from the output. Logprobs, of the chosen token and of the
    top_logprobs most likely ones, are the model's raw log-softmax: before logit_bias, penalties,
    constraints, temperature and truncation (what vLLM returns by default), so they say what the
    model thinks, whatever the sampler then did. logit_bias (token id -> bias) is added to the
    logits before everything else the sampler does (vLLM's order), and so moves greedy choices too.
    """

    max_tokens: int | None = 32  # None: up to the end of the context (validate_request fills it in)
    end_id: int | None = None  # None: the model's end-of-sequence ids
    pad_id: int | None = None  # carried for the serving layer's padded outputs
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # HF semantics, over prompt and output
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: list[list[int]] = field(default_factory=list)
    bad_token_ids: list[list[int]] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # with each output token, this many most likely tokens and their logprobs
    # The prompt's logprobs (each token's given those before it; the first has none), with this many
    # most likely tokens at each position; None: not computed. Its whole prompt is computed then,
    # cached prefix blocks included: a cached block holds KV, not the logits the logprobs come from.
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    n: int = 1  # independent samples (num_return_sequences)
    beam_width: int = 1
    length_penalty: float = 1.0  # beam search: score / generated_length ** length_penalty
    guide: Guide | None = None  # guided decoding: the output must match it (app/engine/guided.py)
    # TensorRT-LLM's names. The model's raw logits (before logit_bias, constraints and temperature,
    # as logprobs are taken) as float32 rows of the vocabulary: of every prompt position, with the
    # first output ([prompt tokens, vocab]; the last row is the one the first token is drawn from),
    # and of each output token's position, with that token. Bounded by max_logits_floats.
    return_context_logits: bool = False
    return_generation_logits: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE or self.top_k == 1

    @property
    def returns_logits(self) -> bool:
        return self.return_context_logits or self.return_generation_logits

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class RequestLimits:
    """What the engine can take, fixed at start-up (built by request_limits)."""

    vocab_size: int
    max_seq_len: int
    max_beam_width: int
    max_num_tokens: int
    chunked_prefill: bool
    max_cache_tokens: int
    tokens_per_block: int
    max_input_len: int | None  # operator caps from the config (None: only the model's limits)
    max_output_len: int | None
    max_return_sequences: int
    max_stop_words: int
    max_stop_word_len: int
    max_logprobs: int
    max_logits_floats: int


def request_limits(config: EngineConfig, vocab_size: int, max_seq_len: int, max_cache_tokens: int) -> RequestLimits:
    """The limits of an engine built from `config` (an EngineConfig): the model's, capped by the config."""
    return RequestLimits(
        # A search's beams run as rows of one step: a wider one would wait at the head of the queue forever.
        vocab_size=vocab_size, max_seq_len=max_seq_len,
        max_beam_width=min(config.max_beam_width, config.max_batch_size, config.max_num_tokens),
        max_num_tokens=config.max_num_tokens, chunked_prefill=config.enable_chunked_prefill,
        max_cache_tokens=max_cache_tokens, tokens_per_block=config.kv_cache_config.tokens_per_block,
        max_input_len=config.max_input_len, max_output_len=config.max_output_len,
        max_return_sequences=config.max_return_sequences, max_stop_words=config.max_stop_words,
        max_stop_word_len=config.max_stop_word_len, max_logprobs=min(config.max_logprobs, vocab_size),
        max_logits_floats=config.max_logits_floats)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)


def _in_vocab(token_ids: list[int], vocab_size: int) -> bool:
    """Every id in [0, vocab_size), for a non-empty list. min and max walk it in C; a generator's Python
    step per id made validate_request 1.7x slower on a 4,096-token prompt."""
    return min(token_ids) >= 0 and max(token_ids) < vocab_size


def _check_token_lists(name: str, seqs: list[list[int]], limits: RequestLimits) -> None:
    _check(len(seqs) <= limits.max_stop_words, name,
           f"{len(seqs)} sequences exceed this server's max_stop_words of {limits.max_stop_words}")
    for seq in seqs:
        _check(len(seq) > 0, name, "must not contain an empty sequence")
        _check(len(seq) <= limits.max_stop_word_len, name, f"a sequence of {len(seq)} tokens exceeds this "
                                                           f"server's max_stop_word_len of {limits.max_stop_word_len}")
        _check(_in_vocab(seq, limits.vocab_size), name, f"token ids must be in [0, {limits.vocab_size})")


def validate_request(prompt_token_ids: list[int], p: SamplingParams, limits: RequestLimits) -> SamplingParams:
    """The request's params, max_tokens filled in where it is None (up to the end of the context,
    within max_output_len and the KV cache); InvalidRequestError naming the first field out of range."""
    n_prompt = len(prompt_token_ids)
    _check(n_prompt > 0, "prompt", "must contain at least one token")
    _check(_in_vocab(prompt_token_ids, limits.vocab_size), "prompt",
           f"token ids must be in [0, {limits.vocab_size})")
    _check(n_prompt < limits.max_seq_len, "prompt",
           f"{n_prompt} tokens exceed the model limit of {limits.max_seq_len - 1} (max_seq_len {limits.max_seq_len})")
    if limits.max_input_len is not None:
        _check(n_prompt <= limits.max_input_len, "prompt",
               f"{n_prompt} tokens exceed this server's max_input_len of {limits.max_input_len}")
    # Every beam holds its own blocks (the prompt's full ones are shared, at most): a search whose
    # beams cannot all fit the pool would wait at the head of the queue forever.
    beams, block = max(1, p.beam_width), limits.tokens_per_block
    cache, per = limits.max_cache_tokens // block // beams * block, " per beam" if beams > 1 else ""
    if p.max_tokens is None:
        room = min(limits.max_seq_len, cache) - n_prompt
        _check(room >= 1, "prompt", f"{n_prompt} tokens leave no room for output in the KV cache of "
                                    f"{cache} tokens{per}")
        p = replace(p, max_tokens=min(room, limits.max_output_len or room))
    _check(p.max_tokens >= 1, "max_tokens", "must be at least 1")
    if limits.max_output_len is not None:
        _check(p.max_tokens <= limits.max_output_len, "max_tokens",
               f"{p.max_tokens} exceeds this server's max_output_len of {limits.max_output_len}")
    _check(n_prompt + p.max_tokens <= limits.max_seq_len, "max_tokens",
           f"prompt ({n_prompt}) + max_tokens ({p.max_tokens}) exceeds max_seq_len {limits.max_seq_len}")
    _check(n_prompt + p.max_tokens <= cache, "max_tokens",
           f"prompt ({n_prompt}) + max_tokens ({p.max_tokens}) exceeds the KV cache of {cache} tokens{per}")
    if not limits.chunked_prefill:
        _check(n_prompt <= limits.max_num_tokens, "prompt",
               f"{n_prompt} tokens exceed max_num_tokens {limits.max_num_tokens} (chunked prefill is off)")
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "length_penalty"):
        _check(math.isfinite(getattr(p, name)), name, "must be a finite number")
    _check(p.temperature >= 0.0, "temperature", "must be >= 0")
    _check(0 <= p.top_k <= limits.vocab_size, "top_k", f"must be in [0, {limits.vocab_size}] (the vocabulary)")
    _check(0.0 < p.top_p <= 1.0, "top_p", "must be in (0, 1]")
    _check(0.0 <= p.min_p <= 1.0, "min_p", "must be in [0, 1]")
    # Bounded where the logits they scale stay finite: 1e-300 turned every logit seen into inf, and
    # gen_len ** 1e4 overflowed a beam search's score and failed its whole step.
    _check(MIN_REPETITION_PENALTY <= p.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
           f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]")
    _check(abs(p.length_penalty) <= MAX_LENGTH_PENALTY, "length_penalty",
           f"must be in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}]")
    _check(-2.0 <= p.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
    _check(-2.0 <= p.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
    _check(0 <= p.min_tokens <= p.max_tokens, "min_tokens", f"must be in [0, max_tokens={p.max_tokens}]")
    _check(1 <= p.n <= limits.max_return_sequences, "n",
           f"must be in [1, {limits.max_return_sequences}] (this server's max_return_sequences)")
    _check(1 <= p.beam_width <= limits.max_beam_width, "beam_width",
           f"must be in [1, {limits.max_beam_width}] (this server's max_beam_width)")
    if p.beam_width > 1:
        _check(p.n <= p.beam_width, "n", f"must not exceed beam_width ({p.beam_width}) with beam search")
        _check(p.guide is None, p.guide.field if p.guide else "", "guided decoding does not combine with beam search")
        _check(p.top_logprobs == 0, "top_logprobs", "does not combine with beam search")
    if p.guide is not None:
        _check(len(p.guide.spec) <= MAX_GUIDE_CHARS, p.guide.field,
               f"{len(p.guide.spec)} characters exceed the limit of {MAX_GUIDE_CHARS}")
        # Holding the end back would leave a finished guide nothing to allow.
        _check(p.min_tokens == 0, "min_tokens", "does not combine with guided decoding (the guide decides where "
                                                "the output ends)")
    for name in ("end_id", "pad_id"):
        value = getattr(p, name)
        _check(value is None or 0 <= value < limits.vocab_size, name, f"must be in [0, {limits.vocab_size})")
    _check(p.seed is None or 0 <= p.seed < SEED_LIMIT, "seed", "must be in [0, 2**64)")
    _check(p.top_logprobs >= 0, "top_logprobs", "must be >= 0")
    _check(p.top_logprobs <= limits.max_logprobs, "top_logprobs",
           f"{p.top_logprobs} exceeds this server's max_logprobs of {limits.max_logprobs}")
    _check(p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= limits.max_logprobs, "prompt_logprobs",
           f"must be in [0, {limits.max_logprobs}] (this server's max_logprobs)")
    _check(len(p.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
           f"{len(p.logit_bias)} entries exceed the limit of {MAX_LOGIT_BIAS}")
    for token, bias in p.logit_bias.items():
        _check(0 <= token < limits.vocab_size, "logit_bias", f"token id {token} is not in [0, {limits.vocab_size})")
        _check(-LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE, "logit_bias",
               f"the bias of token {token} is not in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")
    _check_token_lists("stop_token_ids", p.stop_token_ids, limits)
    _check_token_lists("bad_token_ids", p.bad_token_ids, limits)
    if p.returns_logits:
        _check_logits(n_prompt, p, limits.vocab_size, limits.max_logits_floats)
    return p


def _check_logits(n_prompt: int, p: SamplingParams, vocab: int, most_floats: int) -> None:
    """Logits asked back stay within max_logits_floats; the refusal names the flag that passes it."""
    _check(p.beam_width == 1 or not p.return_generation_logits, "return_generation_logits",
           "does not combine with beam search")
    context = n_prompt * vocab if p.return_context_logits else 0
    generation = p.max_tokens * p.n * vocab if p.return_generation_logits else 0
    if context + generation <= most_floats:
        return
    limit = f"over max_logits_floats ({most_floats}) per request"
    if p.return_context_logits and (context > most_floats or not p.return_generation_logits):
        raise InvalidRequestError("return_context_logits", f"a prompt of {n_prompt} tokens x a vocabulary of {vocab} "
                                                           f"is {context} floats, {limit} (prompts of at most "
                                                           f"{most_floats // vocab} tokens)")
    most = (most_floats - context) // (p.n * vocab)
    with_context = " + the context logits" if context else ""
    raise InvalidRequestError("return_generation_logits", f"max_tokens {p.max_tokens} x {p.n} output(s) x a "
                                                          f"vocabulary of {vocab}{with_context} is "
                                                          f"{context + generation} floats, {limit} (max_tokens of "
                                                          f"at most {most} here)")
