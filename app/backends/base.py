"""One engine protocol for the engine deployment, whatever runs the model underneath.

A backend takes token ids and our SamplingParams and streams RequestOutput deltas (the portable
engine's own output type); leaving the stream early aborts the request. Everything above the
engine (DAG, APIs, LoRA routing, metrics) sees only this.
"""
from __future__ import annotations

import importlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

import numpy as np

from app.config import ServiceConfig
from app.engine.errors import BackendError, InvalidRequestError
from app.engine.guided import GrammarCompiler, Guide
from app.engine.model_dir import resolve_model_dir
from app.engine.model_loader import read_model_config
from app.engine.sampling_params import SamplingParams, request_limits
from app.protocol.messages import AdapterRef


class EngineBackend(Protocol):
    """Constructed as Backend(config, adapters): `adapters` (name -> allowed path) are the config's,
    registered before the first request."""

    name: str

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 adapter: AdapterRef | None) -> AsyncIterator:
        """Yield RequestOutput deltas; the last has finished=True. Raises InvalidRequestError before
        the first output for a request it refuses."""

    async def add_lora(self, name: str, path: str) -> None:
        """Make an adapter known under `name` (loaded now or on first use, as the backend does)."""

    def stats(self) -> dict: ...

    @property
    def healthy(self) -> bool: ...

    def shutdown(self) -> None: ...


class AdapterTable:
    """The adapters a replica knows: name -> path, and the integer id production backends key
    their caches by (TensorRT-LLM's lora_int_id, Triton's lora_task_id). A name, once bound to a
    path (by the config or a first request), keeps it: requests in flight under a name must never
    see its weights change, so another path under a used name is refused (409)."""

    def __init__(self):
        self.paths: dict[str, str] = {}
        self.ids: dict[str, int] = {}
        self._next_id = 1

    def register(self, name: str, path: str, field: str = "lora_adapters") -> int:
        bound = self.paths.get(name)
        if bound is None:
            self.paths[name], self.ids[name] = path, self._next_id
            self._next_id += 1
        elif bound != path:
            raise InvalidRequestError(field, f"LoRA adapter '{name}' is already bound to another path; a name "
                                             "cannot be rebound: send the new adapter under a new name", status=409)
        return self.ids[name]

    def unregister(self, name: str) -> None:
        """Forget a binding whose adapter failed to load, so the name stays free."""
        self.paths.pop(name, None)
        self.ids.pop(name, None)

    def resolve(self, ref: AdapterRef) -> tuple[int, str]:
        """(id, path) of the adapter a request names; a path on the request binds an unused name."""
        if ref.path is not None:
            return self.register(ref.name, ref.path, ref.field), ref.path
        if ref.name not in self.paths:
            raise not_loaded(ref)
        return self.ids[ref.name], self.paths[ref.name]


def not_loaded(ref: AdapterRef) -> InvalidRequestError:
    return InvalidRequestError(ref.field, f"LoRA adapter '{ref.name}' is not loaded on this server; send lora_path "
                                          "(a directory under the configured lora_roots) with the first request, "
                                          "then the name alone")


def refuse_torch_only(params: SamplingParams, backend: str) -> None:
    """Fields only the torch engine implements so far: refused by name, not silently ignored.
    (return_context_logits, return_generation_logits and logit_bias are carried by every backend.)"""
    if params.top_logprobs:
        raise InvalidRequestError("top_logprobs", f"is not supported by the {backend} backend yet")
    if params.prompt_logprobs is not None:  # 0 asks too: for the prompt tokens' own logprobs
        raise InvalidRequestError("prompt_logprobs", f"(echo with logprobs on /v1/completions) is not supported by "
                                                     f"the {backend} backend yet")


def bias_row(logit_bias: dict[int, float], vocab: int) -> np.ndarray:
    """logit_bias (checked already) as TensorRT-LLM's embedding bias: float32 [vocab], added to the
    logits before sampling, zero where the request sets nothing."""
    row = np.zeros(vocab, dtype=np.float32)
    for token, bias in logit_bias.items():
        row[token] = bias
    return row


# Why context logits may come short: a prefix served from the KV cache is not computed again, so it
# may have no rows (NVIDIA's Model Optimizer LLM wrapper documents turning reuse off for them).
CONTEXT_ROWS_HINT = ("with KV cache block reuse a cached prompt prefix may get no rows: set "
                     "kv_cache_config.enable_block_reuse false to serve context logits")


def logits_rows(tensor, rows: int, vocab: int, what: str, backend: str, hint: str = "") -> np.ndarray:
    """A production backend's logits (a torch tensor or an array, [>= rows, >= vocab]) as our float32
    [rows, vocab]: its first `rows` rows, and the model's vocabulary only (TensorRT-LLM may pad it
    to vocab_size_padded). Fewer rows than tokens is the backend's failure, said plainly."""
    if hasattr(tensor, "detach"):  # torch.Tensor: TensorRT-LLM's LLM API type
        tensor = tensor.detach().float().cpu().numpy()
    array = np.asarray(tensor, dtype=np.float32).reshape(-1, np.shape(tensor)[-1])
    if len(array) < rows or array.shape[1] < vocab:
        raise BackendError(backend, f"returned {what} of shape {list(array.shape)} where {rows} rows of a "
                                    f"vocabulary of {vocab} were due{'; ' + hint if hint else ''}")
    return np.ascontiguousarray(array[:rows, :vocab])


def context_rows(tensor, num_prompt: int, vocab: int, backend: str) -> np.ndarray:
    """A backend's context logits as [prompt tokens, vocab]; fewer rows fail the request."""
    return logits_rows(tensor, num_prompt, vocab, "context_logits", backend, hint=CONTEXT_ROWS_HINT)


def generation_rows(tensor, num_tokens: int, vocab: int, backend: str, build_hint: str) -> np.ndarray:
    """A response's generation logits, one float32 row per new token ([0, vocab] for none). None
    where tokens came is the backend's failure; `build_hint` asks how it was built."""
    if tensor is None:
        if num_tokens:
            raise BackendError(backend, f"returned no generation_logits though the request asked for them "
                                        f"({build_hint})")
        return np.zeros((0, vocab), np.float32)
    return logits_rows(tensor, num_tokens, vocab, "generation_logits", backend)


CONTAINER = "nvcr.io/nvidia/tritonserver:<xx.yy>-trtllm-python-py3"


def import_backend_package(module: str, pip_name: str) -> object:
    """Import a production backend's package, or fail start-up with one sentence saying where it lives."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise RuntimeError(f"backend needs the '{pip_name}' package ({exc.name} is not importable); run this "
                           f"config in NVIDIA's {CONTAINER} container, or use backend: torch") from None


# The `json` guide (a JSON object, as OpenAI's json_object) as a schema: TensorRT-LLM's own JSON
# guide (json_object, guide type "json") is xgrammar's built-in JSON grammar, which allows arrays too.
OBJECT_SCHEMA = '{"type": "object"}'


class ServedModel:
    """What a production backend reads of the model itself: its directory (tokenizer, limits), the
    request limits (the model's, capped by the config; these backends size their own KV cache), its
    end-of-sequence ids, and a grammar compiler to check guides with."""

    def __init__(self, config: ServiceConfig):
        self.dir: Path = resolve_model_dir(config.model)
        model = read_model_config(self.dir)
        self.eos_ids = list(model.eos_token_ids)
        max_seq_len = min(config.max_seq_len or model.max_seq_len, model.max_seq_len)
        cache_tokens = config.kv_cache_config.max_tokens or max_seq_len * config.max_batch_size
        self.limits = request_limits(config.engine_config(), model.vocab_size, max_seq_len, cache_tokens)
        self.grammars = GrammarCompiler(self.dir, model.vocab_size, tuple(self.eos_ids))

    def check_guide(self, guide: Guide) -> None:
        """Parse the guide as the torch engine does on arrival (xgrammar, no vocabulary needed): one
        that does not parse is a 400 naming its field now, not a failure inside the executor later."""
        self.grammars.check(guide)

    def end_ids(self, params: SamplingParams) -> tuple[int, list[int]]:
        """The end id to send (the request's, else the model's first) and the model's other end ids,
        which must stop generation too (none when the request names its own or ignores the end)."""
        if params.end_id is not None:
            return params.end_id, []
        return self.eos_ids[0], [] if params.ignore_eos else self.eos_ids[1:]


class StopWatcher:
    """Stop sequences a backend does not handle as the portable engine does, given those semantics:
    a stop sequence counts once min_tokens are out, is cut from the output, and tokens that may
    still begin one are held back until they cannot. Each token's logprob and logits row (where
    the request asks) are held and cut with it."""

    def __init__(self, stop_sequences: list[list[int]], min_tokens: int = 0):
        self.sequences = [list(s) for s in stop_sequences]
        self.min_tokens = min_tokens
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.rows: list[np.ndarray | None] = []  # generation logits, [vocab] per token (None once emitted)
        self.emitted = 0
        self.matched: list[int] | None = None

    def push(self, new: list[int], logprobs: list[float] | None, final: bool,
             logits: np.ndarray | None = None) -> tuple[list[int], list[float] | None, np.ndarray | None,
                                                        list[int] | None]:
        """Tokens (their logprobs, their logits rows [tokens, vocab]) to emit now, and the stop
        sequence that matched, if one did."""
        start = len(self.tokens)
        self.tokens += new
        self.logprobs += logprobs or []
        if logits is not None:
            self.rows += list(logits)
        upto = len(self.tokens)
        for end in range(max(start + 1, self.min_tokens), len(self.tokens) + 1):
            self.matched = next((s for s in self.sequences if self.tokens[max(end - len(s), 0):end] == s), None)
            if self.matched is not None:
                upto = end - len(self.matched)
                break
        if self.matched is None and not final:
            upto -= self._possible_start()
        upto = max(upto, self.emitted)  # a stop sequence whose head was already sent: the rest is cut
        tokens = self.tokens[self.emitted:upto]
        probs = self.logprobs[self.emitted:upto] if logprobs is not None else None
        rows = None
        if logits is not None and upto > self.emitted:
            rows = np.stack(self.rows[self.emitted:upto])
            self.rows[self.emitted:upto] = [None] * (upto - self.emitted)
        self.emitted = upto
        return tokens, probs, rows, self.matched

    def _possible_start(self) -> int:
        """How many trailing tokens could still be the head of a stop sequence."""
        unsent = len(self.tokens) - self.emitted
        for k in range(min(max((len(s) for s in self.sequences), default=1) - 1, unsent), 0, -1):
            if any(self.tokens[-k:] == s[:k] for s in self.sequences):
                return k
        return 0
