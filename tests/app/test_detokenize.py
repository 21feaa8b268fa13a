"""The detokenizer stage's logic over engine outputs, with SmolLM2's tokenizer: stop strings end an
output, and the request ends early only once every output it asked for has ended."""
import asyncio

import pytest

from app.detokenize import text_chunks
from app.engine.outputs import CompletionOutput, RequestOutput
from app.engine.sampling_params import SamplingParams
from app.protocol.messages import TokenizedJob
from app.text import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return Tokenizer(smollm2_dir)


def _run(tokenizer, n: int, deltas: list[list[tuple[int, str, str | None]]]) -> tuple[list, int]:
    """Chunks for `deltas` (per engine output: (index, text, finish_reason) of each sequence), and
    how many deltas the engine's stream had given when the detokenizer closed it."""
    given = 0

    async def engine():
        nonlocal given
        for i, delta in enumerate(deltas):
            given += 1
            yield RequestOutput("r", [CompletionOutput(index, tokenizer.encode(text, add_special_tokens=False),
                                                       None, 0.0, finish) for index, text, finish in delta],
                                finished=i == len(deltas) - 1)

    async def collect():
        job = TokenizedJob("r", [1, 2], SamplingParams(n=n), stop=["END"])
        return [chunk async for chunk in text_chunks(tokenizer, job, engine())]

    return asyncio.run(collect()), given


def _texts(chunks) -> dict[int, str]:
    texts = {}
    for chunk in chunks:
        for out in chunk.outputs:
            texts[out.index] = texts.get(out.index, "") + out.text
    return texts


def test_a_stop_string_in_one_output_leaves_its_siblings_running(tokenizer):
    # Output 1 sends nothing with the first delta (admitted a step later, or holding back a
    # possible stop prefix) while output 0 hits the stop string in it.
    chunks, given = _run(tokenizer, 2, [[(0, "Hi END", None)],
                                        [(0, " more", None), (1, "Hello there", None)],
                                        [(1, " friend", "length")]])
    assert not chunks[0].finished and given == 3
    assert _texts(chunks) == {0: "Hi ", 1: "Hello there friend"}
    assert chunks[-1].finished and chunks[-1].outputs[-1].finish_reason == "length"


def test_an_output_the_engine_ended_counts_as_ended(tokenizer):
    """Output 0 ends at its length, output 1 on a stop string: nothing is left to wait for (the
    engine went on computing output 1 to its max_tokens)."""
    chunks, given = _run(tokenizer, 2, [[(0, "a", "length"), (1, "b", None)], [(1, " END c", None)],
                                        [(1, "read", "length")]])
    assert given == 2 and chunks[-1].finished and _texts(chunks) == {0: "a", 1: "b "}


def test_an_output_finished_earlier_is_not_finished_again(tokenizer):
    """The engine's last output names every output's end, those that ended steps before too (with
    no tokens): passed on, a tool call in one was parsed and sent twice (the openai client joined
    them into invalid JSON) and its finish_reason repeated."""
    chunks, _ = _run(tokenizer, 2, [[(0, "a", "stop"), (1, "b", None)], [(0, "", "stop"), (1, " c", "length")]])
    assert [[(o.index, o.finish_reason) for o in c.outputs] for c in chunks] == [[(0, "stop"), (1, None)],
                                                                                [(1, "length")]]


def test_the_request_ends_once_every_output_hit_a_stop_string(tokenizer):
    chunks, given = _run(tokenizer, 2, [[(0, "a END", None), (1, "b", None)], [(1, " END c", None)],
                                        [(0, "never", None)], [(1, "read", "length")]])
    assert given == 2 and chunks[-1].finished  # leaving cancels the engine's request upstream
    assert _texts(chunks) == {0: "a ", 1: "b "}
    assert [(o.index, o.finish_reason, o.stop_reason) for o in chunks[-1].outputs] == [(1, "stop", "END")]


def test_text_offsets_point_into_the_text_with_split_characters_and_special_tokens(tokenizer):
    """OpenAI's text_offset: where each token starts in the text. Characters split over tokens
    (accents, CJK, an emoji) count once, and a special token in an echoed prompt, which the echo's
    text leaves out, counts nothing. Checked against the tokenizer: from a token that starts a
    character, the text from its offset on is the decode of the tokens from it on."""
    text = "Café au lait, 日本語 and 🙂 twice: 🙂."
    ids = tokenizer.encode(text, add_special_tokens=False)
    split = [tokenizer.token_piece(i)[1] for i in ids]
    assert any(raw and raw[0] >> 6 == 0b10 for raw in split), "the text must split a character over tokens"
    special = tokenizer.hf.all_special_ids[0]
    prompt_ids = [special, *tokenizer.encode("Say: ", add_special_tokens=False)]
    job = TokenizedJob("r", prompt_ids, SamplingParams(logprobs=0, prompt_logprobs=0), stop=[],
                       echo=tokenizer.decode(prompt_ids))

    async def engine():
        yield RequestOutput("r", [CompletionOutput(0, ids[:5], [0.0] * 5, 0.0)], finished=False,
                            prompt_logprobs=[None] + [0.0] * (len(prompt_ids) - 1))
        yield RequestOutput("r", [CompletionOutput(0, ids[5:], [0.0] * (len(ids) - 5), 0.0, "length")], finished=True)

    async def collect():
        return [chunk async for chunk in text_chunks(tokenizer, job, engine())]

    chunks = asyncio.run(collect())
    tokens = [t for chunk in chunks for out in chunk.outputs for t in out.tokens]
    assert _texts(chunks)[0] == text and len(tokens) == len(ids)
    _assert_offsets(tokenizer, text, ids, tokens)
    prompt = chunks[0].prompt
    assert prompt.text == "Say: " and [t.offset for t in prompt.tokens][:2] == [0, 0]
    _assert_offsets(tokenizer, prompt.text, prompt_ids, prompt.tokens)


def _assert_offsets(tokenizer, text: str, ids: list[int], tokens) -> None:
    """Each token whose tokens before it decode to whole characters starts where their text ends,
    and from there the text is theirs and its own."""
    assert [t.offset for t in tokens] == sorted(t.offset for t in tokens)
    for i, token in enumerate(tokens):
        before = tokenizer.decode(ids[:i])
        if not before.endswith("\ufffd"):
            assert token.offset == len(before) and text.startswith(before), (i, token)


def test_text_offsets_follow_a_sentencepiece_decode(tmp_path):
    """Llama 2's kind of tokenizer drops the first token's space and writes a byte token per
    U+FFFD: offsets count what the decode writes, not the tokens' own bytes."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    words = ["\u2581Hi", "\u2581there", "\u2581!"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: 3 + i for i, w in enumerate(words)}}
    vocab |= {f"<0x{b:02X}>": len(vocab) + b for b in range(256)}
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    rust.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    rust.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path)
    sentencepiece = Tokenizer(tmp_path)
    for ids in ([1, 3, 4, 5], [vocab["<0xE6>"], vocab["<0x97>"], 3, 4]):
        job = TokenizedJob("r", [1, 3], SamplingParams(logprobs=0, prompt_logprobs=0), stop=[], echo="Hi")

        async def engine():
            yield RequestOutput("r", [CompletionOutput(0, ids, [0.0] * len(ids), 0.0, "length")], finished=True,
                                prompt_logprobs=[None, 0.0])

        async def collect():
            return [chunk async for chunk in text_chunks(sentencepiece, job, engine())]
        (chunk,) = asyncio.run(collect())
        (out,) = chunk.outputs
        _assert_offsets(sentencepiece, out.text, ids, out.tokens)
        _assert_offsets(sentencepiece, "Hi", [1, 3], chunk.prompt.tokens)
    assert [t.offset for t in out.tokens] == [0, 0, 2, 5]  # '\ufffd\ufffd Hi there'
