"""N-gram speculation (prompt lookup): guesses of a sequence's next tokens, taken from its own past.

Answers that copy spans of their prompt (editing, extraction, code changes) repeat what came
before: where the sequence's last n tokens occurred earlier, the tokens that followed them then are
a good guess for what follows now. The scheduler puts the guesses after the sequence's last token
in one decode step, a row each; the model's greedy choice at every row checks the guess after it,
and the sequence takes the guesses up to the first miss plus the model's own token there. Greedy
output is the same token for token as without guesses, only fewer steps compute it.

A guessing step needs the sequence's last token on the host, so it cannot overlap the step before
it (the overlap scheduler plans a step while the previous one computes). Where guessing finds
nothing, or nothing right, the sequence pauses it for 1, 2, 4, ... up to MAX_PAUSE_STEPS steps, and
those steps overlap: text that never repeats costs about what it costs without speculation.
"""
from __future__ import annotations

from array import array

from app.engine.config import SpeculativeConfig
from app.engine.sequence import Sequence


MAX_PAUSE_STEPS = 32
SEARCH_TOKENS = 8192  # how far back a tail is looked for: the cost of a lookup stays flat in long contexts
MAX_MISALIGNED = 16  # byte matches across token boundaries skipped per tail before giving up on it


class NGramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.max_draft_len, self.max_ngram = config.max_draft_len, config.max_matching_ngram_size

    @staticmethod
    def speculates(seq: Sequence) -> bool:
        """Whether the model's choice at a row is its greedy argmax over the raw logits, so that one
        step's rows check guesses exactly: greedy, no beams, guide, bias, bans or penalties, and past
        min_tokens (before it, each row would ban the end id or not)."""
        p = seq.params
        return (p.greedy and p.beam_width == 1 and p.guide is None and not p.logit_bias and not p.bad_token_ids
                and not p.needs_penalties and (p.ignore_eos or seq.num_output_tokens >= p.min_tokens))

    @staticmethod
    def missed(seq: Sequence) -> None:
        """Nothing to guess, or every guess wrong: guessing costs the step its overlap with the host,
        so the sequence steps without it for a while, twice as long after each miss in a row."""
        seq.guess_misses += 1
        seq.guess_pause = min(2 ** (seq.guess_misses - 1), MAX_PAUSE_STEPS)

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to min(max_draft_len, limit) tokens that followed the latest earlier occurrence of the
        longest tail (max_matching_ngram_size tokens down to 1) that occurred before; [] if none."""
        limit = min(limit, self.max_draft_len)
        if limit < 1 or len(token_ids) < 2:
            return []
        # bytes.rfind scans in C: a few microseconds for thousands of tokens, where a Python loop
        # over them would cost a small model's whole decode step.
        window = token_ids[-SEARCH_TOKENS:]
        tokens = array("i", window)
        data, width = tokens.tobytes(), tokens.itemsize
        for n in range(min(self.max_ngram, len(window) - 1), 0, -1):
            tail = data[-n * width:]
            end = len(data) - width  # a match must leave at least one token after it, before the tail's end
            for _ in range(MAX_MISALIGNED):
                at = data.rfind(tail, 0, end)
                if at < 0:
                    break
                if at % width == 0:  # a match across token boundaries is no match
                    start = at // width + n
                    return window[start:start + limit]
                end = at + len(tail) - 1
        return []
