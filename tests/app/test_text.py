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


def test_token_pieces_are_each_tokens_own_text_and_bytes(tokenizer):
    """Bytes concatenate to the text, across a character split over tokens, whose parts show as
    U+FFFD alone; special tokens are their own text."""
    text = "Hi 漢字 café 🦙"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.token_piece(i) for i in ids]
    assert b"".join(raw for _, raw in pieces).decode() == text
    assert pieces[1:4] == [(" \ufffd", b" \xe6"), ("\ufffd", b"\xbc"), ("\ufffd", b"\xa2")]  # 漢, split in 3
    assert all(piece == raw.decode(errors="replace") for piece, raw in pieces)
    assert tokenizer.token_piece(2) == ("<|im_end|>", b"<|im_end|>")


def test_sentencepiece_pieces_keep_their_space_and_fallback_bytes(tmp_path):
    """A SentencePiece-style vocabulary (Llama 2): U+2581 is a space that decoding one id alone
    drops, and <0xHH> is one raw byte."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "<0xE6>": 2, "\u2581the": 3, "é": 4}
    backend = Backend(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>").save_pretrained(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.decode([3]) == "the"
    assert [tokenizer.token_piece(i) for i in (3, 2, 4, 1)] == [
        (" the", b" the"), ("\ufffd", b"\xe6"), ("é", "é".encode()), ("</s>", b"</s>")]
