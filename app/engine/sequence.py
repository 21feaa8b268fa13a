"""One generated sequence: its tokens, KV blocks, stop state and timing."""
from __future__ import annotations

import enum
import time

import numpy as np
import torch

from app.engine.outputs import FinishReason
from app.engine.sampling_params import SamplingParams


PENDING_TOKEN = -1  # stands for a token still on the device (overlapped steps); never a model input


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """Token ids (prompt then output), the KV blocks holding them, and per-sequence state.

    num_computed_tokens counts tokens whose KV is in the cache, or will be once the steps already
    planned have run (the scheduler counts a plan's tokens when it makes it); tokens past it are
    computed by the next plan. A step whose tokens reach num_tokens samples a new token.
    """

    def __init__(self, seq_id: int, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, eos_ids: frozenset[int], generator: torch.Generator | None,
                 adapter_id: str | None = None, arrival_ns: int | None = None):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index  # which of the request's n outputs this is
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.eos_ids = frozenset([params.end_id]) if params.end_id is not None else eos_ids
        self.generator = generator
        self.adapter_id = adapter_id
        # What the prefix cache keys this sequence's blocks by besides their tokens: the adapter's
        # name and which load of it (LLMEngine sets it), as a name may be registered again with new weights.
        self.adapter_key = adapter_id
        self.grammar = None  # guided decoding: a GrammarMatcher (app/engine/guided.py) the tokens advance
        self.left_its_guide = False  # a token its grammar refused: nothing the guide allowed could be drawn
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks registered so far
        self.output_logprobs: list[float] = []
        # Aligned with output_logprobs: (ids, logprobs) of the likeliest tokens, or None where not asked
        self.output_top_logprobs: list[tuple[list[int], list[float]] | None] = []
        self.cumulative_logprob = 0.0
        # prompt_logprobs requests, first output only: entry i scores prompt token i + 1 (row i's logits)
        self.prompt_logprobs: list[float] = []
        self.prompt_top_logprobs: list[tuple[list[int], list[float]] | None] = []
        # return_context_logits, first output only: raw logits rows of the prompt, in order, taken
        # with the prompt logprobs (which count the rows scored) and the last one with the first token
        self.context_logits: list[np.ndarray] = []
        self.num_context_rows = 0  # rows taken so far (those sent too)
        # return_generation_logits: each output token's raw logits row (None once emitted)
        self.generation_logits: list[np.ndarray | None] = []
        self.num_emitted = 0  # output tokens already handed to the caller
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | list[int] | None = None
        self.beam_group = None  # set by BeamGroup for beam-search sequences
        self.arrival_ns = arrival_ns or time.time_ns()
        self.first_scheduled_ns = 0
        self.first_token_ns = 0
        self.last_token_ns = 0
        self.reused_blocks = 0
        self.new_blocks = 0
        self.num_preemptions = 0
        self.draft_tokens = 0  # speculation: tokens guessed for it, and those the model confirmed
        self.accepted_draft_tokens = 0
        self.guess_misses = 0  # guessing steps in a row that found nothing, or nothing right
        self.guess_pause = 0  # steps to run without guessing (overlapped) before the next try
        self.draft_kv_tokens = 0  # draft-target speculation: positions whose draft-model KV is its tokens'
        # Overlapped steps: the last token is still on the device, as row `pending_row` of the step
        # in flight; its id here is a placeholder until the step is read back (Scheduler.update).
        self.pending_row: int | None = None

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_rows(self) -> bool:
        """Whether prompt rows (every prompt position but the last, which samples) still owe their
        logprobs or logits: the request asks (prompt_logprobs, return_context_logits), this is its
        first output (the others share the prompt), and some are not taken yet (a preempted one
        keeps those taken)."""
        return ((self.params.prompt_logprobs is not None or self.params.return_context_logits) and self.index == 0
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def samples_last_context_row(self) -> bool:
        """Whether the context logits still want a row its next sampling row gives: the prompt's
        last position (once it samples, every context row is taken)."""
        return (self.params.return_context_logits and self.index == 0
                and self.num_context_rows < self.num_prompt_tokens)

    @property
    def prompt_done(self) -> bool:
        """Whether everything the first output carries about the prompt is taken."""
        return not self.needs_prompt_rows and not self.samples_last_context_row

    # -- generation --------------------------------------------------------------------------------
    def append_token(self, token_id: int, logprob: float,
                     top_logprobs: tuple[list[int], list[float]] | None = None,
                     logits: np.ndarray | None = None) -> None:
        if self.grammar is not None and not self.grammar.accept(token_id):
            # Every token the grammar allowed was masked out too (bad words, logit_bias): the draw
            # fell outside it. check_stop ends the sequence here.
            self.left_its_guide = True
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self.output_top_logprobs.append(top_logprobs)
        if self.params.return_generation_logits:  # such requests never overlap: no placeholder comes here
            self.generation_logits.append(logits)
        self.cumulative_logprob += logprob
        now = time.time_ns()
        self.first_token_ns = self.first_token_ns or now
        self.last_token_ns = now

    def add_prompt_logprob(self, logprob: float, top: tuple[list[int], list[float]] | None) -> None:
        """The next prompt token's logprob (and the likeliest at its position, where asked)."""
        self.prompt_logprobs.append(logprob)
        self.prompt_top_logprobs.append(top)

    def add_context_logits(self, rows: np.ndarray) -> None:
        """The prompt's next raw logits rows, [rows, vocab]."""
        self.context_logits.append(rows)
        self.num_context_rows += len(rows)

    def take_generation_logits(self, start: int, end: int) -> np.ndarray | None:
        """Output tokens [start, end)'s logits rows as one array (None for no tokens); the sequence
        lets them go."""
        if end <= start:
            return None
        rows = np.stack(self.generation_logits[start:end])
        self.generation_logits[start:end] = [None] * (end - start)
        return rows

    def append_pending(self, row: int) -> None:
        """The token sampled in row `row` of the step in flight: counted now, read back later."""
        self.token_ids.append(PENDING_TOKEN)
        self.output_logprobs.append(0.0)
        self.output_top_logprobs.append(None)
        self.pending_row = row

    def resolve_pending(self, token_id: int, logprob: float,
                        top_logprobs: tuple[list[int], list[float]] | None = None,
                        logits: np.ndarray | None = None) -> None:
        self.drop_pending()
        self.append_token(token_id, logprob, top_logprobs, logits)

    def drop_pending(self) -> None:
        if self.pending_row is not None:
            self.token_ids.pop()
            self.output_logprobs.pop()
            self.output_top_logprobs.pop()
            self.pending_row = None

    def check_stop(self) -> FinishReason | None:
        """After append_token: decide whether the sequence ends, and cut what must not be output."""
        p = self.params
        last = self.token_ids[-1]
        if self.left_its_guide:
            self._truncate(1)
            return self._finish(FinishReason.ABORT, None)
        if not p.ignore_eos and last in self.eos_ids:
            self._truncate(1)
            return self._finish(FinishReason.STOP, last)
        if self.grammar is not None and self.grammar.terminated:
            # The guide is complete (its end id accepted): nothing may follow, ignore_eos or not.
            self._truncate(1)
            return self._finish(FinishReason.STOP, last)
        n_out = self.num_output_tokens
        if p.stop_token_ids and n_out >= p.min_tokens:
            for stop in p.stop_token_ids:
                if len(stop) <= n_out and self.token_ids[-len(stop):] == stop:
                    self._truncate(len(stop))
                    return self._finish(FinishReason.STOP, stop)
        if n_out >= p.max_tokens:
            return self._finish(FinishReason.LENGTH, None)
        return None

    def _truncate(self, n: int) -> None:
        for _ in range(n):
            self.token_ids.pop()
            self.cumulative_logprob -= self.output_logprobs.pop()
            self.output_top_logprobs.pop()
            if self.params.return_generation_logits:
                self.generation_logits.pop()

    def _finish(self, reason: FinishReason, stop_reason) -> FinishReason:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        return reason

    def num_emittable(self) -> int:
        """Output tokens safe to stream: those that cannot still turn out to start a stop sequence."""
        n_out = self.num_output_tokens
        if self.finish_reason is not None or not self.params.stop_token_ids:
            return n_out
        out = self.token_ids
        hold = 0
        for stop in self.params.stop_token_ids:
            for k in range(min(len(stop) - 1, n_out), hold, -1):
                if out[len(out) - k:] == stop[:k]:
                    hold = k
                    break
        return n_out - hold

    def fork(self, seq_id: int) -> Sequence:
        """A copy sharing history (beam search); the caller gives it its blocks."""
        child = Sequence(seq_id, self.request_id, self.index, [], self.params, self.eos_ids, None,
                         self.adapter_id, self.arrival_ns)
        child.adapter_key = self.adapter_key
        child.token_ids = list(self.token_ids)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.output_logprobs = list(self.output_logprobs)
        child.output_top_logprobs = list(self.output_top_logprobs)
        child.cumulative_logprob = self.cumulative_logprob
        child.prompt_logprobs, child.prompt_top_logprobs = self.prompt_logprobs, self.prompt_top_logprobs
        child.num_context_rows = self.num_context_rows  # a beam's prompt rows are its root's
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.status = self.status
        child.beam_group = self.beam_group
        child.first_scheduled_ns = self.first_scheduled_ns
        child.first_token_ns = self.first_token_ns
        child.last_token_ns = self.last_token_ns
        return child
