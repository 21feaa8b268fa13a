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
