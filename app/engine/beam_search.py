"""Beam search over a group of sequences that advance in lockstep.

The selection rule is transformers' (generation/utils.py, _beam_search): each step keeps the
2 * width best (beam, token) continuations by cumulative log-prob; those among the first `width`
that end (end id, a stop sequence's last token, or max_tokens) enter the finished list with
score / length ** length_penalty; the best `width` that do not end run on. The search stops when
no running beam can beat the worst of `width` finished ones (transformers' early_stopping=False
heuristic).
"""
from __future__ import annotations

from dataclasses import dataclass

from app.engine.outputs import FinishReason
from app.engine.sequence import Sequence

_DEAD = -1.0e9  # transformers' score for continuations that must not run on


@dataclass
class Hypothesis:
    score: float  # length-normalised
    token_ids: list[int]  # output tokens, end id excluded
    logprobs: list[float]
    finish_reason: FinishReason


@dataclass
class Continuation:
    parent: Sequence
    token_id: int
    logprob: float
    score: float  # cumulative log-prob of the beam after this token


class BeamGroup:
    def __init__(self, root: Sequence, width: int):
        self.width = width
        self.seqs = [root]  # every beam ever created (the scheduler adds its forks)
        self.running = [root]
        self.scores = [0.0]
        self.finished: list[Hypothesis] = []
        self.improvable = True
        self.done = False
        root.beam_group = self

    def select(self, candidates: dict[Sequence, tuple[list[float], list[int]]]) -> list[Continuation]:
        """One step: update finished hypotheses; return the continuations that keep running."""
        pool = []
        for seq, score in zip(self.running, self.scores):
            values, ids = candidates[seq]
            pool.extend((score + v, v, seq, t) for v, t in zip(values, ids))
        pool.sort(key=lambda c: -c[0])
        pool = pool[:2 * self.width]
        gen_len = self.running[0].num_output_tokens + 1
        p = self.running[0].params
        ends = [(not p.ignore_eos and c[3] in c[2].eos_ids) or _stop_ended(c[2], c[3]) is not None
                or gen_len >= p.max_tokens for c in pool]
        if self.improvable:
            self._add_finished(pool, ends, gen_len, p.length_penalty)
        keep = sorted(range(len(pool)), key=lambda i: -(pool[i][0] + _DEAD * ends[i]))[:self.width]
        chosen = [Continuation(pool[i][2], pool[i][3], pool[i][1], pool[i][0] + _DEAD * ends[i]) for i in keep]
        best_running = chosen[0].score / gen_len ** p.length_penalty
        worst_finished = min(h.score for h in self.finished) if len(self.finished) == self.width else _DEAD
        self.improvable = self.improvable and best_running > worst_finished
        self.done = not self.improvable or all(ends)
        return [] if self.done else chosen

    def _add_finished(self, pool, ends, gen_len: int, length_penalty: float) -> None:
        for rank, ((score, logprob, seq, token), end) in enumerate(zip(pool, ends)):
            if rank >= self.width or not end:
                continue
            is_eos = token in seq.eos_ids and not seq.params.ignore_eos
            stop = _stop_ended(seq, token)
            # As in plain decoding, the end id and a stop sequence are not part of the output.
            cut = 1 if is_eos else len(stop) if stop is not None else 0
            tokens = (seq.output_token_ids + [token])[:gen_len - cut]
            logprobs = (seq.output_logprobs + [logprob])[:gen_len - cut]
            reason = FinishReason.STOP if is_eos or stop is not None else FinishReason.LENGTH
            self.finished.append(Hypothesis(score / gen_len ** length_penalty, tokens, logprobs, reason))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.width:]


def _stop_ended(seq: Sequence, token: int) -> list[int] | None:
    """The stop sequence (of stop_token_ids) that `token` completes on `seq`, where min_tokens allows
    one to end it (Sequence.check_stop's rule for plain decoding)."""
    p, n_out = seq.params, seq.num_output_tokens + 1
    if n_out < p.min_tokens:
        return None
    for stop in p.stop_token_ids:
        before = seq.token_ids[len(seq.token_ids) - len(stop) + 1:]  # what the stop's other tokens must match
        if len(stop) <= n_out and stop[-1] == token and before == stop[:-1]:
            return stop
    return None
