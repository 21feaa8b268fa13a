"""Values outside every route's declared types and ranges, as Hypothesis strategies and as fixed
lists (tests/serve/test_hostile.py sends them). Python's json writes what strict JSON cannot:
NaN / Infinity as bare tokens and a lone surrogate as its escape ("\\ud800"), which is what a
hostile client can send and Python's json.loads accepts."""
from __future__ import annotations

from hypothesis import strategies as st

from app.protocol.triton import ALIASES

SERVED = "smollm2-hostile"
MODELS = ("ensemble", "tensorrt_llm", "tensorrt_llm_bls", SERVED)

HUGE_INTS = (2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**30, -1, -(2**63), -(2**64), -(10**30))
NON_FINITE = (float("nan"), float("inf"), float("-inf"))
TINY_FLOATS = (1e-300, 5e-324, -1e-300, 1e308, -0.0)
SURROGATES = ("\ud800", "\udfff", "a\udc00b", "\ud83d", "\udc00\ud800")
EDGES = (0, 1, 2, 8, 9, 0.5, 1.0, 2.0, 2**64 - 1, "\U0001f600", ["\n"], True, False)  # in range, at its edges
WRONG_TYPES = ([], [1, 2], [[]], [None], {}, {"a": 1}, "", "1", "abc", True, False, None, 1.5, [2**64])

TRITON_FIELDS = (
    "text_input", "input_ids", "input_lengths", "max_tokens", "bad_words", "stop_words", "stop_token_ids",
    "bad_token_ids", "end_id", "pad_id", "top_k", "top_p", "temperature", "min_p", "length_penalty",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "seed", "beam_width", "best_of",
    "num_return_sequences", "stream", "ignore_eos", "stop", "exclude_input_in_output", "return_log_probs",
    "return_perf_metrics", "request_id", "lora_task_id", "lora_path", "lora_id", "lora_name", *ALIASES)
OPENAI_FIELDS = (
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream",
    "stop", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
    "logprobs")
COMPLETION_FIELDS = (*OPENAI_FIELDS, "prompt", "echo")
CHAT_FIELDS = (*OPENAI_FIELDS, "messages")

# Fields an error may name for one another: a spelling and what it means, or fields checked together.
_FAMILIES = (
    {"n", "best_of", "num_return_sequences", "beam_width"},
    {"text_input", "input_ids", "prompt", "messages"},
    {"lora_task_id", "lora_path", "lora_id", "lora_name"},
    {"max_tokens", "min_tokens", "max_completion_tokens"},
    {"stop_words", "stop"},
    {"stop", "request_id"},  # a stop request names the request to stop by its id
)


def has_surrogate(text: str) -> bool:
    return any("\ud800" <= c <= "\udfff" for c in text)


def names_for(fields) -> tuple[str, ...]:
    """Every name a 4xx error may use for a request that touched `fields`. A key that is not valid
    Unicode cannot be written back in a UTF-8 answer, so there the error may name the body."""
    names = set()
    for name in fields:
        name = str(name)
        names |= {name, ALIASES.get(name, name)} | ({"body"} if has_surrogate(name) else set())
    for family in _FAMILIES:
        if names & family:
            names |= family
    return tuple(sorted(names))


def _hostile_leaf():
    return st.one_of(
        st.sampled_from(HUGE_INTS + NON_FINITE + TINY_FLOATS + SURROGATES + WRONG_TYPES),
        st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
        st.text(max_size=12), st.sampled_from(SURROGATES).map(lambda s: "Hi " + s), st.sampled_from(EDGES))


def hostile_values():
    """One value of any JSON type, mostly out of range: huge, non-finite, tiny, mistyped, invalid text;
    some at the edges of the range, so that successful answers and streams are judged too."""
    return st.recursive(_hostile_leaf(), lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=6)


def unknown_names():
    return st.one_of(st.sampled_from(("no_such_field", "TEXT_INPUT", " top_k", "", *SURROGATES)),
                     st.text(min_size=1, max_size=10))


def field_names(known):
    """A declared field (mostly) or one that is not."""
    return st.one_of(st.sampled_from(known), st.sampled_from(known), st.sampled_from(known), unknown_names())


def mutations(known):
    """One or two (field, hostile value) pairs."""
    return st.lists(st.tuples(field_names(known), hostile_values()), min_size=1, max_size=2,
                    unique_by=lambda pair: pair[0])


def tensor_meta():
    """A KServe tensor whose name, shape or datatype is malformed (the data is a valid top_k)."""
    good = {"name": "top_k", "shape": [1], "datatype": "INT32", "data": [1]}
    key = st.sampled_from(("name", "shape", "datatype", "data"))
    bad = st.one_of(hostile_values(), st.sampled_from(([5], [2, 2], [-1], [2**64], [0], "BYTES", "FP64", "BOOGUS")))
    return st.tuples(key, bad).map(lambda kv: {**good, kv[0]: kv[1]} if kv[0] != "data" or kv[1] is not None
                                   else {k: v for k, v in good.items() if k != "data"})


def envelope():
    """A malformed KServe request envelope: (key, value) for id, outputs, parameters or inputs."""
    shapes = st.sampled_from((5, "x", [5], [{"name": 5}], [{"name": ["text_output"]}], [{}], {}, [[]]))
    return st.tuples(st.sampled_from(("id", "outputs", "parameters", "inputs")),
                     st.one_of(hostile_values(), shapes))


def model_paths():
    """Model names for GET /v2/models/{m}: the real ones, unknown ones, encodings of invalid text."""
    odd = ("nope", "%ED%A0%80", "%FF", "%00", "a" * 3000, "ensemble%00", "%2e%2e", "%F0%9F%98%80", "ENSEMBLE",
           "ensemble%20", "1e309", "-1")
    return st.one_of(st.sampled_from(MODELS), st.sampled_from(odd),
                     st.text(st.characters(codec="ascii", categories=("L", "N")), min_size=1, max_size=20))


def query_strings():
    pairs = st.lists(st.tuples(st.sampled_from(("x", "model", "timeout", "%FF", "a" * 200)),
                               st.sampled_from(("1e309", "%ED%A0%80", "NaN", str(2**64), "", "[]", "%00"))),
                     max_size=3)
    return pairs.map(lambda kv: "?" + "&".join(f"{k}={v}" for k, v in kv) if kv else "")
