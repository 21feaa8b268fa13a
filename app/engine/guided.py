"""Guided decoding: output held to a JSON schema, any JSON, a regex, an EBNF grammar or structural
tags (free text, with JSON of a schema between each begin/end pair) (xgrammar).

A request's `Guide` is parsed when it arrives (a guide that does not parse is a 400 at once), then
compiled against the vocabulary on a thread of its own, once per distinct guide (xgrammar's
compiler caches by content, bounded): however long a hostile guide takes, the engine loop and
unguided requests never wait for it. Other guides queue behind it: a compile past
COMPILE_TIMEOUT_S fails its request (400), one that never started in that time is dropped (503), as
is any past MAX_QUEUED_COMPILES. Each of the request's
sequences walks the grammar with its own matcher. Before a step samples, the matcher's token
bitmask removes every token the grammar does not allow next; after, the sampled token advances
the matcher. A step's mask therefore needs the previous step's tokens on the host: under the
overlap scheduler the step's forward pass is queued first and its sampling only after the previous
step is read back, so the host fills every guided row's mask (one bitmask, one copy) while the GPU
computes.
"""
from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.engine.errors import InvalidRequestError

if TYPE_CHECKING:  # torch loads where a mask is made: the Ingress parses guides without it
    import torch

KINDS = ("json", "json_schema", "regex", "ebnf", "structural_tag")
CACHE_BYTES = 256 << 20  # compiled grammars kept (xgrammar evicts the least recently used)
COMPILE_TIMEOUT_S = 10.0  # from arrival, queueing behind other compiles included
MAX_QUEUED_COMPILES = 64  # past this, a guide that needs compiling is refused (503) at once
RECENT_GUIDES = 16  # compiled guides kept at hand: a repeat is ready at once, with no hop to the compile thread
# Bounded strings written as patterns (_bounded_strings_as_patterns): xgrammar 0.2.8 compiles a
# JSON-schema pattern's repeat up to 128 only (past it the compile fails); a pattern's parse costs
# about its bound squared (4.5 ms at 128), so a schema's patterns stop at PATTERN_CHARS in all.
MAX_PATTERN_LENGTH = 128
PATTERN_CHARS = 1024
# Keywords whose values are data, not schemas, and those whose values map names to schemas.
_DATA_KEYWORDS = ("const", "enum", "default", "examples")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


@dataclass(frozen=True)
class Guide:
    """What the output must match. `kind`: json (a JSON object, as OpenAI's json_object),
    json_schema, regex, ebnf or structural_tag; `spec`: the schema (JSON text), the regex, the
    grammar, or the structural tag as JSON text (TensorRT-LLM's form: {"structures": [{"begin",
    "schema", "end"}], "triggers": [...]}); "" for json. `field` is the request field it came
    from, named in errors."""
    kind: str
    spec: str = ""
    field: str = "guided_decoding"


class GrammarCompiler:
    """Compiles guides for one model's vocabulary; its tokenizer is read on first use."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_ids: tuple[int, ...]):
        self.model_dir, self.vocab_size, self.eos_ids = model_dir, vocab_size, eos_ids
        self._compiler = None
        self._batch = None  # fills many matchers' masks at once, on threads of its own
        self._json_safe = None  # a bitmask row: the tokens JSON text can hold (_json_safe_row)
        self._lock = threading.Lock()
        self.timeout_s = COMPILE_TIMEOUT_S
        self._queued = 0  # submitted, not yet done
        self._recent: OrderedDict[tuple[str, str], Future] = OrderedDict()  # (kind, spec): its compile, done
        # One thread: a slow guide delays other guided requests (each within its timeout), never the loop.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")

    def _get(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=list(self.eos_ids) or None)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_BYTES)
                self._batch = xgrammar.BatchGrammarMatcher(max_threads="auto")
                self._json_safe = _json_safe_row(info, self.vocab_size, self.eos_ids)
            return self._compiler

    def check(self, guide: Guide):
        """The guide parsed as written (no vocabulary involved: fast); InvalidRequestError naming
        its field when it does not parse."""
        import xgrammar

        if guide.kind not in KINDS:
            raise InvalidRequestError(guide.field, f"guide type {guide.kind!r} is not supported ({', '.join(KINDS)})")
        tag = _structural_tag(guide) if guide.kind == "structural_tag" else None
        with _compile_errors(guide):
            if tag is not None:
                return xgrammar.Grammar.from_structural_tag(tag)
            if guide.kind == "json":
                return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
            if guide.kind == "json_schema":
                return xgrammar.Grammar.from_json_schema(guide.spec, any_whitespace=False)
            if guide.kind == "regex":
                return xgrammar.Grammar.from_regex(guide.spec)
            return xgrammar.Grammar.from_ebnf(guide.spec)

    def compile(self, guide: Guide) -> Future:
        """Check the guide now, compile it on the compile thread: a future of its compiled grammar.
        A guide compiled lately comes back done: its request joins the next step, where a hop to
        the compile thread (which needs the GIL the engine's thread holds) could cost it one."""
        key = (guide.kind, guide.spec)
        with self._lock:
            if (ready := self._recent.get(key)) is not None:
                self._recent.move_to_end(key)
                return ready
        grammar = self.check(guide)
        with self._lock:
            if self._queued >= MAX_QUEUED_COMPILES:
                raise InvalidRequestError(guide.field, "the guide compiler is busy; retry", status=503)
            self._queued += 1
        future = self._pool.submit(self._compile, guide, grammar)
        future.add_done_callback(functools.partial(self._done, key))
        return future

    def shutdown(self) -> None:
        """Queued compiles are dropped; one running finishes on its own (xgrammar cannot be stopped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _done(self, key: tuple[str, str], future: Future) -> None:
        with self._lock:
            self._queued -= 1
            if not future.cancelled() and future.exception() is None:
                self._recent[key] = future
                self._recent.move_to_end(key)
                if len(self._recent) > RECENT_GUIDES:
                    self._recent.popitem(last=False)

    def _compile(self, guide: Guide, grammar):
        """On the compile thread: JSON schemas with their bounded strings as patterns (whose parse
        takes milliseconds, here, within the compile's timeout, not on the engine's thread)."""
        import xgrammar

        with _compile_errors(guide):
            compiler = self._get()
            if guide.kind == "json_schema":  # xgrammar caches it by the schema's text
                return compiler.compile_json_schema(_bounded_strings_as_patterns(guide.spec), any_whitespace=False)
            if guide.kind == "structural_tag":
                grammar = xgrammar.Grammar.from_structural_tag(_structural_tag(guide, patterns=True))
            return compiler.compile_grammar(grammar)

    def matcher(self, compiled, guide: Guide) -> GrammarMatcher:
        """A fresh matcher at the start of `guide`'s compiled grammar."""
        import xgrammar

        json_safe = self._json_safe if guide.kind in ("json", "json_schema") else None
        return GrammarMatcher(xgrammar.GrammarMatcher(compiled), self.vocab_size, self._batch, json_safe)


@contextmanager
def _compile_errors(guide: Guide):
    """xgrammar's RuntimeError/ValueError as an InvalidRequestError naming the guide's field."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with its reason
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", reason)[:300]  # xgrammar's time and source line
        raise InvalidRequestError(guide.field, f"does not compile as {guide.kind}: {reason}") from None


def _structural_tag(guide: Guide, patterns: bool = False):
    """The guide's structural tag as xgrammar's; InvalidRequestError naming the part at fault when
    its JSON does not have TensorRT-LLM's shape (xgrammar itself checks triggers against begins).
    `patterns`: each schema's bounded strings as patterns (_bounded_strings_as_patterns)."""
    import xgrammar

    def need(ok: bool, where: str, what: str):
        if not ok:
            raise InvalidRequestError(guide.field, f"structural tag: {where} must be {what}")
    try:
        spec = json.loads(guide.spec)
    except ValueError as exc:
        raise InvalidRequestError(guide.field, f"structural tag: not JSON ({exc})") from None
    # "type" as TensorRT-LLM's OpenAI server leaves it in the guide it passes on
    need(isinstance(spec, dict) and set(spec) <= {"type", "structures", "triggers"}
         and spec.get("type", "structural_tag") == "structural_tag",
         "the guide", 'an object {"structures": [...], "triggers": [...]} (and "type": "structural_tag")')
    structures, triggers = spec.get("structures"), spec.get("triggers")
    need(isinstance(structures, list) and len(structures) > 0, "structures", "a non-empty list")
    need(isinstance(triggers, list) and all(isinstance(t, str) for t in triggers), "triggers", "a list of strings")
    for i, s in enumerate(structures):
        need(isinstance(s, dict) and set(s) == {"begin", "schema", "end"}, f"structures[{i}]",
             'an object with "begin", "schema" and "end"')
        need(isinstance(s["begin"], str) and isinstance(s["end"], str), f"structures[{i}].begin and end", "strings")
        need(isinstance(s["schema"], dict), f"structures[{i}].schema", "a JSON schema object")
    items = [xgrammar.StructuralTagItem(begin=s["begin"], end=s["end"],
                                        schema=_bounded_strings_as_patterns(s["schema"]) if patterns else s["schema"])
             for s in structures]
    return xgrammar.StructuralTag.from_legacy_structural_tag(items, triggers)


def _bounded_strings_as_patterns(schema: str | dict) -> str | dict:
    """The schema with each string of maxLength <= MAX_PATTERN_LENGTH (and no pattern or format of
    its own) written as the pattern of that many characters that are not control characters, in
    document order up to PATTERN_CHARS of bounds. The two accept the same JSON strings, except raw
    control characters, which JSON forbids and xgrammar 0.2.8's maxLength admits
    (mlc-ai/xgrammar#800). The pattern is the cheaper to follow: xgrammar's maxLength costs about a
    millisecond per row a few characters before the bound (mlc-ai/xgrammar#852); 64 rows walking
    the benchmark's schema fill in 4.4 ms against 0.49 as patterns (one thread of an H200
    machine's CPU). A schema that is not JSON, or too deep to walk, is returned as it came, for
    xgrammar to judge."""
    budget = [PATTERN_CHARS]
    try:
        if isinstance(schema, str):
            return json.dumps(_rewrite(json.loads(schema), budget))
        return _rewrite(schema, budget)
    except (ValueError, RecursionError):
        return schema


def _rewrite(schema, budget: list[int]):
    if isinstance(schema, list):
        return [_rewrite(item, budget) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rewritten = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            rewritten[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names, whatever they are, to schemas
            rewritten[key] = {name: _rewrite(item, budget) for name, item in value.items()}
        else:
            rewritten[key] = _rewrite(value, budget)
    low, high = rewritten.get("minLength", 0), rewritten.get("maxLength")
    if (rewritten.get("type") == "string" and "pattern" not in rewritten and "format" not in rewritten
            and type(low) is int and type(high) is int and 0 <= low <= high <= min(MAX_PATTERN_LENGTH, budget[0])):
        budget[0] -= high
        del rewritten["maxLength"]
        rewritten.pop("minLength", None)
        rewritten["pattern"] = f"^[^\\x00-\\x1f]{{{low},{high}}}$"
    return rewritten


class GrammarMatcher:
    """One sequence's position in its grammar. `batch`: the compiler's xgrammar BatchGrammarMatcher,
    which fills a step's masks for all its matchers at once. `json_safe`, for JSON guides: the row
    of tokens JSON text can hold, which every mask of this matcher keeps to."""

    def __init__(self, matcher, vocab_size: int, batch, json_safe: torch.Tensor | None = None):
        self.xgrammar_matcher, self.vocab_size, self.batch = matcher, vocab_size, batch
        self.json_safe = json_safe

    def accept(self, token_id: int) -> bool:
        return self.xgrammar_matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        return self.xgrammar_matcher.is_terminated()


def new_bitmask(rows: int, vocab_size: int, pin: bool) -> torch.Tensor:
    """int32 words of 32 tokens, a row for each row of a step's logits up to its last guided one,
    on the host (pinned where the copy to the device must not wait). Bit t of a filled row is set
    where its grammar allows t next."""
    import torch
    import xgrammar

    return torch.empty(xgrammar.get_bitmask_shape(rows, vocab_size), dtype=torch.int32, pin_memory=pin)


def fill_bitmask(matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
    """Row rows[i] of `bitmask` for matchers[i], all at once on xgrammar's threads (without the GIL).
    From any thread: the bitmask may be the engine's, made under inference mode, which only inference
    mode may update in place (a fill thread is not in it)."""
    import torch

    matchers[0].batch.batch_fill_next_token_bitmask([m.xgrammar_matcher for m in matchers], bitmask, rows)
    json_rows = [row for m, row in zip(matchers, rows) if m.json_safe is not None]
    if json_rows:
        with torch.inference_mode():
            bitmask[json_rows] &= next(m.json_safe for m in matchers if m.json_safe is not None)


def _json_safe_row(info, vocab_size: int, stop_ids: tuple[int, ...]) -> torch.Tensor:
    """A bitmask row of the tokens with no byte below 0x20, and the stop ids. JSON as our guides
    write it (compact, any_whitespace=False) needs none of the others: whitespace is a space, and
    inside strings RFC 8259 wants control characters escaped. xgrammar 0.2.8's grammar for a
    string with minLength/maxLength lets them in raw (mlc-ai/xgrammar#800), which strict parsers
    (Python's json, JavaScript's JSON.parse) refuse."""
    import numpy as np
    import torch

    words = new_bitmask(1, vocab_size, pin=False).shape[1]
    allowed = np.zeros(words * 32, dtype=bool)
    vocab = info.decoded_vocab  # built anew on each read
    allowed[:len(vocab)] = [all(byte >= 0x20 for byte in token) for token in vocab]
    allowed[list(stop_ids)] = True
    bits = allowed.reshape(words, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    return torch.from_numpy(bits.sum(axis=1).astype(np.uint32).view(np.int32))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """-inf where the bitmask's row clears a token, in `rows` of the logits, where the logits are
    (one kernel on the GPU)."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)


def warm_up_bitmask_kernel(device: torch.device, vocab_size: int) -> None:
    """Compile the GPU kernel that applies masks for each row count Triton tells apart (1, a multiple
    of 16, any other) before serving, so no guided step waits for a compile. Nothing without xgrammar."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return
    import torch

    logits = torch.zeros((16, vocab_size), dtype=torch.float32, device=device)
    bitmask = new_bitmask(16, vocab_size, pin=False).fill_(-1).to(device)
    for count in (1, 2, 16):
        apply_bitmask(logits, bitmask, list(range(count)))
