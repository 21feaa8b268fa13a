"""Speculative decoding: guesses of a sequence's next tokens, checked by the model in one step.

Two proposers guess. N-gram (prompt lookup, here): answers that copy spans of their prompt
(editing, extraction, code changes) repeat what came before, so where the sequence's last n tokens
occurred earlier, the tokens that followed them then are a good guess for what follows now. Draft
model (app/engine/draft_model.py): a smaller model with the same tokenizer decodes the guesses
greedily. Either way the guesses are fixed tokens: the draft distribution is a point mass, which
the acceptance rule below is exact for. The scheduler puts the guesses after the sequence's last
token in one decode step, a row each; the model's choice at every row checks the guess after it, and the
sequence takes the guesses up to the first miss plus the model's own token there (`confirmed`).

The choice at row i is what plain decoding would make there: greedy, the argmax; sampled, a draw
from the row's distribution p_i after temperature, top-k, top-p and min-p (and logit bias and
single-token bans, which do not depend on the position). For sampled rows this is speculative
sampling (Leviathan et al., Chen et al.) with a point-mass draft q = [d_i]: accept d_i with
probability min(1, p_i(d_i) / q(d_i)) = p_i(d_i), else draw from the residual max(p_i - q, 0),
which is p_i without d_i, renormalised. Drawing t ~ p_i and accepting iff t == d_i is exactly
that: P(accept) = P(t = d_i) = p_i(d_i), and given t != d_i, t is distributed as p_i restricted to
tokens other than d_i, renormalised. So every token taken has the distribution p_i of its
position, given the tokens before it, and when every guess is confirmed the last row's draw is the
bonus token from p_K: the output is distributed as plain sampling's. Rows after the first miss are
drawn too (the step is one vectorised draw) and dropped unread.

Seeded requests stay reproducible, and their outputs are plain decoding's token for token (up to
float rounding across batch shapes): each row draws from the sequence's own generator in row
order, one draw per position as plain decoding does, and once the step is read back the generator
goes back to its state after the last row taken (Scheduler._take_guesses): the next step draws the
dropped rows' noise again, for the positions it was drawn for. (The noise of position m decides
nothing before position m is sampled, so drawing it again keeps every draw independent of the
tokens before it.) Unseeded requests share the engine's generator: their dropped draws are spent.

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


class Proposer:
    """What the scheduler asks of a way of guessing: which sequences may guess, how many guesses
    stood, what a miss costs, and the guesses themselves (`propose_all`)."""

    max_draft_len: int

    def propose_all(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Guesses for each (sequence, most guesses) pair, the sequence's last token known on the host
        and its KV slots for the guesses held; [] where there is nothing to guess (a proposer that
        finds nothing calls `missed` for it)."""
        raise NotImplementedError

    @staticmethod
    def speculates(seq: Sequence) -> bool:
        """Whether the sampler's processing of a row is the same at every position, so that one
        step's rows see what plain decoding would at theirs: greedy or sampled, with or without
        logit bias and single-token bad words; not beams, guides, penalties or longer bad words
        (they read the tokens before the row, which the sampler takes from the host, without the
        guesses), nor before min_tokens (each row would ban the end id or not)."""
        p = seq.params
        return (p.beam_width == 1 and p.guide is None and not p.needs_penalties
                and all(len(bad) == 1 for bad in p.bad_token_ids)
                and (p.ignore_eos or seq.num_output_tokens >= p.min_tokens))

    @staticmethod
    def missed(seq: Sequence) -> None:
        """Nothing to guess, or every guess wrong: guessing costs the step its overlap with the host,
        so the sequence steps without it for a while, twice as long after each miss in a row."""
        seq.guess_misses += 1
        seq.guess_pause = min(2 ** (seq.guess_misses - 1), MAX_PAUSE_STEPS)

    @staticmethod
    def confirmed(draft: list[int], tokens: list[int]) -> int:
        """How many guesses the model confirmed: `tokens` are its choices at the guessing rows (row 0
        after the last known token, row i after draft[i - 1]), and draft[i] stands while row i and
        those before it chose their guesses. The sequence takes tokens[:confirmed + 1] (the module
        docstring says why that keeps a sampled request's distribution)."""
        accepted = 0
        while accepted < len(draft) and draft[accepted] == tokens[accepted]:
            accepted += 1
        return accepted


class NGramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig):
        self.max_draft_len, self.max_ngram = config.max_draft_len, config.max_matching_ngram_size

    def propose_all(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        drafts = [self.propose(seq.token_ids, limit) for seq, limit in wanted]
        for (seq, _), draft in zip(wanted, drafts):
            if not draft:  # nothing to guess
                self.missed(seq)
        return drafts

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
