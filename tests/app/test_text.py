"""Incremental detokenization against the real SmolLM2 tokenizer: streams equal whole decodes."""
import pytest

from app.text import IncrementalDetokenizer, Tokenizer

SAMPLES = [
    "The capital of France is Paris.",
    "北京是中国的首都，东京是日本的首都。",
    "Emoji 🚀🔥👩‍👩‍👧 and accents: déjà vu, naïve café.",
    "Mixed: 東京 🍣 sushi — ¿qué?",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return Tokenizer(smollm2_dir)


@pytest.mark.parametrize("text", SAMPLES)
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_concatenation_equals_whole_decode(tokenizer, text, chunk):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)] + [detok.finish()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_spanning_tokens_is_cut_and_never_sent(tokenizer):
    text = "one two three four five six"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["ee fo"])
    pieces = []
    for t in ids:
        pieces.append(detok.push([t]))
        if detok.stopped:
            break
    pieces.append(detok.finish())
    assert "".join(pieces) == "one two thr"
    assert detok.stopped == "ee fo"


def test_without_a_match_everything_held_back_comes_out_at_the_end(tokenizer):
    ids = tokenizer.encode("abc def ghi", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["zzzz"])
    streamed = "".join(detok.push([t]) for t in ids)
    assert streamed + detok.finish() == "abc def ghi"
    assert detok.stopped is None


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids) + detok.finish() == "Hi"


def test_a_stop_sequence_cut_on_ids_is_rechecked_on_text(tokenizer):
    """'🌟🌟🌟' as a stop word tokenizes without the leading space the first star has in context, so
    the engine matches its ids one star late; the text must still be cut before the first star."""
    ids = tokenizer.encode(" 🌟🌟🌟🌟🌟")
    stop_ids = tokenizer.encode_words(["🌟🌟🌟"])[0]
    at = next(i for i in range(len(ids)) if ids[i:i + len(stop_ids)] == stop_ids)
    assert at > 0 and tokenizer.decode(ids[:at]) != " "  # the ids matched late
    detok = IncrementalDetokenizer(tokenizer, ["🌟🌟🌟"])
    assert detok.push(ids[:at]) + detok.finish(stop_ids) == " " and detok.stopped == "🌟🌟🌟"
    plain = IncrementalDetokenizer(tokenizer, ["never"])
    assert plain.push(ids[:at]) + plain.finish(stop_ids) == tokenizer.decode(ids[:at])  # no string: ids' cut stands
