"""The detokenizer stage's logic: one request's engine outputs (token deltas) to text chunks, with
stop strings applied and each output's tokens spelled out where logprobs were asked for."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from app.engine.outputs import RequestOutput
from app.protocol.messages import PromptText, TextChunk, TextOutput, TokenizedJob, TokenText
from app.text import IncrementalDetokenizer, Tokenizer


class TextOffsets:
    """Where each token of one text starts in it (OpenAI's text_offset): the characters the text has
    before the token. The text is the tokenizer's own decode, grown a token at a time as the
    detokenizer grows it, so every quirk of that decode counts as it does in the text: a character
    split over tokens counts once, at the token that completes it; special tokens count nothing;
    SentencePiece's first space is not there."""

    def __init__(self, tokenizer: Tokenizer):
        self._text = IncrementalDetokenizer(tokenizer)

    def advance(self, token_id: int, piece: str) -> int:
        """The token's offset, given its text alone (`piece`); the text then grows by it. Where the
        text grows by more than the piece (bytes held back before it that it completed, or that
        decode replaced), the piece is what ends the growth."""
        start = len(self._text.text)
        self._text.push([token_id])
        return max(start, len(self._text.text) - len(piece))


def token_texts(tokenizer: Tokenizer, token_ids: list[int], top_logprobs: list | None,
                offsets: TextOffsets) -> list[TokenText]:
    """Each token decoded on its own (Tokenizer.token_piece), with its alternatives if asked
    (`top_logprobs`, aligned with the tokens; None where there are none) and its offset in the text."""
    tokens = []
    for i, token_id in enumerate(token_ids):
        text, raw = tokenizer.token_piece(token_id)
        ids, values = (top_logprobs and top_logprobs[i]) or ((), ())
        top = [(*tokenizer.token_piece(t), value) for t, value in zip(ids, values)]
        tokens.append(TokenText(text, raw, offsets.advance(token_id, text), top))
    return tokens


def _prompt(tokenizer: Tokenizer, job: TokenizedJob, out: RequestOutput) -> PromptText:
    """The prompt to echo, and its tokens and logprobs where the engine computed them (they come
    with its first output)."""
    if out.prompt_logprobs is None:
        return PromptText(job.echo)
    tokens = token_texts(tokenizer, job.prompt_token_ids, out.prompt_top_logprobs, TextOffsets(tokenizer))
    return PromptText(job.echo, tokens, out.prompt_logprobs)


async def text_chunks(tokenizer: Tokenizer, job: TokenizedJob,
                      outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[TextChunk]:
    """A chunk per engine output. Once every output the request asked for has ended (on a stop
    string here, or as the engine ended it), the chunk is the last and `outputs` is closed:
    upstream, that cancels the engine's request."""
    detoks: dict[int, IncrementalDetokenizer] = {}
    ended: set[int] = set()  # outputs that are over, by a stop string or as the engine ended them
    offsets: dict[int, TextOffsets] = {}  # where each output's next token starts in its text
    echoed = False
    async with aclosing(outputs):
        async for out in outputs:
            chunk = TextChunk([], out.finished, len(job.prompt_token_ids), out.metrics,
                              context_logits=out.context_logits)
            if job.echo is not None and not echoed:
                chunk.prompt, echoed = _prompt(tokenizer, job, out), True
            for c in out.outputs:
                if c.index in ended:
                    # Ended by a stop string (the engine may still be producing), or sent again,
                    # empty, with the request's last output: it was finished and said so already.
                    continue
                detok = detoks.setdefault(c.index, IncrementalDetokenizer(tokenizer, job.stop))
                text = detok.push(c.token_ids)
                finish, reason = c.finish_reason, c.stop_reason
                if detok.stopped is not None:
                    finish, reason = "stop", detok.stopped
                if finish is not None:
                    text += detok.finish(reason if isinstance(reason, list) else None)
                    if detok.stopped is not None:
                        finish, reason = "stop", detok.stopped
                    ended.add(c.index)
                tokens = None
                if c.logprobs is not None:
                    tokens = token_texts(tokenizer, c.token_ids, c.top_logprobs,
                                         offsets.setdefault(c.index, TextOffsets(tokenizer)))
                chunk.outputs.append(TextOutput(c.index, text, c.token_ids, c.logprobs, c.cumulative_logprob,
                                                finish, reason, tokens, c.generation_logits))
            # Every output the request asked for, not only those seen so far: a sibling may not have
            # sent its first tokens yet (admitted later, or holding back a possible stop prefix).
            chunk.finished = chunk.finished or len(ended) == job.params.n
            if not (chunk.outputs or chunk.finished or chunk.prompt is not None or chunk.context_logits is not None):
                continue  # only outputs that had ended already: nothing to say
            yield chunk
            if chunk.finished:
                return
