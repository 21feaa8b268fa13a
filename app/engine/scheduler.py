"""The in-flight batcher: which sequences compute how many tokens this step.

Plain Python over a BlockManager; no model, no tensors. Each step runs three phases:
  1. running sequences (decodes, then unfinished prefills), in arrival order;
  2. waiting sequences (new or preempted), while the batch, the token budget and the policy allow;
  3. under MAX_UTILIZATION, preemption (by recompute) frees blocks for phase 1 when they run out.
STATIC batching (Triton's V1) admits a new batch only once the previous one has finished.
With a proposer (speculative decoding), a decode may carry guesses of the tokens after its last one,
a row each, while every decode row of the step fits one decode graph (app/engine/speculative.py).

The scheduler owns the sequences' progress: a plan counts its tokens as computed when it is made,
and update() takes what the step sampled (tokens, placeholders while overlapped, beam candidates),
hashes the blocks it filled and lets finished sequences go with their blocks.
"""
from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from app.engine.beam_search import BeamGroup
from app.engine.block_manager import BlockManager
from app.engine.config import BatchingType, SchedulerPolicy
from app.engine.sampler import SamplerOutput
from app.engine.sequence import Sequence, SequenceStatus
from app.engine.speculative import Proposer

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed this step, guesses included
    start: int  # the first of them (the plan has counted them in seq.num_computed_tokens already)
    draft: list[int] = field(default_factory=list)  # guessed tokens after the sequence's last one

    @property
    def is_decode(self) -> bool:
        """One known token (the last), and perhaps guesses after it: a row each, decode-shaped."""
        return self.num_tokens - len(self.draft) == 1

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a new token is sampled."""
        return self.start + self.num_tokens - len(self.draft) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerLimits:
    max_batch_size: int
    max_num_tokens: int
    chunked_prefill: bool
    policy: SchedulerPolicy
    batching: BatchingType
    max_loras: int = 8  # distinct adapters in flight at once (the device cache's slots)


class Scheduler:
    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager, seq_ids: Iterator[int] | None = None,
                 proposer: Proposer | None = None):
        """`seq_ids` numbers beam-search forks (the engine shares the counter that numbers its sequences)."""
        self.limits = limits
        self.blocks = block_manager
        self.proposer = proposer
        self.seq_ids = seq_ids or itertools.count()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pending_copies: list[tuple[int, int]] = []
        self.num_preempted_total = 0

    # -- membership --------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Finished or aborted: leave the queues and give the blocks back now."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.blocks.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step plan -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(block_copies=self.pending_copies)
        self.pending_copies = []
        budget = self._schedule_running(out, self.limits.max_num_tokens)
        if self.limits.batching is BatchingType.INFLIGHT or not self.running:
            self._schedule_waiting(out, budget)
        # Counted now, not when the step is read back: an overlapped step is read back only after
        # the next one is planned, and that plan must start where this one ends.
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
        return out

    # -- after the step ----------------------------------------------------------------------------
    def update(self, plan: SchedulerOutput, rows: list[Sequence], sampled: SamplerOutput | None) -> list[Sequence]:
        """Take what the step `plan` sampled, row by row (`rows`: the sequences the model runner
        sampled for), and return the rows' sequences that took it.

        An overlapped step comes here twice. Launched (`sampled` None), each row gets a placeholder,
        which the next plan computes from the device; read back, placeholders become the tokens.
        A row whose sequence ended or was aborted since the step was launched holds no placeholder
        of it: its token is dropped."""
        live = {row: seq for row, seq in enumerate(rows) if not seq.is_finished or seq.pending_row == row}
        drafted = self._take_guesses(plan, live, sampled) if sampled is not None else set()
        if sampled is not None:
            tokens, logprobs, tops, logits = sampled.token_ids, sampled.logprobs, sampled.top_logprobs, sampled.logits
            for row, seq in live.items():
                if seq.beam_group is None and seq not in drafted:  # beams take theirs as they advance, below
                    seq.resolve_pending(tokens[row], logprobs[row], tops.get(row), logits.get(row))  # (or appends)
        # Every computed token is known by now (placeholders lie past them). Hashed before any
        # sequence below goes, so that a finished one leaves its full blocks cached.
        for item in plan.scheduled:
            if not item.seq.is_finished:  # an ended sequence has given its blocks back
                self.blocks.register_full_blocks(item.seq)
        beams: dict[BeamGroup, dict[Sequence, tuple[list[float], list[int]]]] = {}
        for row, seq in live.items():
            if seq in drafted:
                if seq.finish_reason is not None and not seq.is_finished:
                    self.remove(seq)
            elif sampled is None:
                seq.append_pending(row)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.remove(seq)  # its last token is in flight: nothing more to compute
            elif seq.beam_group is not None:
                beams.setdefault(seq.beam_group, {})[seq] = sampled.beam_candidates[row]
            elif seq.check_stop() is not None and not seq.is_finished:
                self.remove(seq)  # (one that reached max_tokens when launched has gone already)
        for group, candidates in beams.items():
            self._advance_beams(group, candidates)
        return list(dict.fromkeys(live.values()))  # a guessing sequence had a row per guess

    def _take_guesses(self, plan: SchedulerOutput, live: dict[int, Sequence], sampled: SamplerOutput) -> set[Sequence]:
        """Sequences that guessed take the guesses the model confirmed: row i's token is the
        model's choice after guess i (row 0: after the last known token; greedy or drawn, as plain
        decoding would), so the guesses up to the first that differs from it are right, and that
        row's token follows them (NGramProposer.confirmed). Each token goes through the stop checks
        as it is appended; the cache holds the rows whose input was right. A seeded generator goes
        back to its state after the last row taken. Returns the sequences (their rows are done with)."""
        if not any(item.draft for item in plan.scheduled):
            return set()
        first_row = {}
        for row, seq in live.items():
            first_row.setdefault(seq, row)
        drafted = set()
        for item in plan.scheduled:
            seq = item.seq
            if not item.draft or seq not in first_row:
                continue
            drafted.add(seq)
            known = item.start + 1  # tokens whose inputs were known, the last one included
            rows = range(first_row[seq], first_row[seq] + len(item.draft) + 1)
            accepted = self.proposer.confirmed(item.draft, [sampled.token_ids[row] for row in rows])
            if accepted:
                seq.guess_misses = 0
            else:
                self.proposer.missed(seq)
            taken = 0
            for row in rows[:accepted + 1]:
                seq.append_token(sampled.token_ids[row], sampled.logprobs[row], sampled.top_logprobs.get(row),
                                 sampled.logits.get(row))
                taken += 1
                if seq.check_stop() is not None:
                    break
            state = sampled.generator_states.get(rows[taken - 1])
            if state is not None:  # the rows dropped drew noise that the next positions draw again
                seq.generator.set_state(state)
            seq.draft_tokens += len(item.draft)
            seq.accepted_draft_tokens += min(accepted, taken)  # not those an end cut off
            # Rows past the first wrong guess wrote KV the next steps overwrite: not computed. So did
            # a draft model's passes past it (app/engine/draft_model.py).
            seq.num_computed_tokens = min(known + accepted, seq.num_tokens)
            seq.draft_kv_tokens = min(seq.draft_kv_tokens, seq.num_computed_tokens)
        return drafted

    def _advance_beams(self, group: BeamGroup, candidates: dict) -> None:
        """The chosen continuations run on: a beam chosen twice forks (the child shares its
        blocks), one not chosen leaves with its blocks; a search that is done leaves whole."""
        chosen = group.select(candidates)
        parents = {c.parent for c in chosen}
        for seq in group.running:  # first: the forks below take the blocks these give back
            if seq not in parents:
                self.remove(seq)
        kept, beams = set(), []
        for c in chosen:  # fork before any token is appended: children copy the parent as it was
            if c.parent in kept:
                child = c.parent.fork(next(self.seq_ids))
                self._make_room_to_fork(c.parent)
                copy = self.blocks.fork(c.parent, child)
                if copy:
                    self.pending_copies.append(copy)
                self.running.insert(self.running.index(c.parent) + 1, child)
                group.seqs.append(child)
                beams.append(child)
            else:
                kept.add(c.parent)
                beams.append(c.parent)
        for seq, c in zip(beams, chosen):
            seq.append_token(c.token_id, c.logprob)
        group.running = beams
        group.scores = [c.score for c in chosen]

    def _make_room_to_fork(self, parent: Sequence) -> None:
        """A fork copies the parent's partial last block into a fresh one. The group's reservation
        holds it from other admissions, but under MAX_UTILIZATION a running sequence's growth may
        have taken it: preempt as that growth would."""
        while self.blocks.fork_needs_block(parent) and not self.blocks.num_free_blocks:
            evicts = self.limits.policy is SchedulerPolicy.MAX_UTILIZATION
            victim = self._pick_victim() if evicts else None
            if victim is None:  # not while GUARANTEED_NO_EVICT's reservations hold, nor with beams alone
                raise RuntimeError("no free KV block for a beam search fork")
            self._preempt(victim, SchedulerOutput())

    def _tokens_for(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining <= budget:
            return remaining
        # A preempted sequence recomputes in chunks whatever the setting: prompt and output together
        # may pass max_num_tokens, and it waits at the head of the queue, ahead of every request.
        return budget if self.limits.chunked_prefill or seq.num_preemptions else 0

    def _guessing_decodes(self) -> list[Sequence]:
        """The running decodes that may guess this step: all of them, while every decode row of the
        step (a guess is a row) fits one decode graph, where the batch is small and a step costs
        about the same for a few more rows; none in a fuller batch, which gains nothing from them."""
        if self.proposer is None:
            return []
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        if len(decodes) * (self.proposer.max_draft_len + 1) > self.limits.max_batch_size:
            return []
        return [s for s in decodes if self.proposer.speculates(s)]

    def guesses_next(self) -> bool:
        """Whether the next plan gives some decode guesses. The step before it must then be read
        back first (a guess follows the last token), so the engine does not overlap that plan."""
        return any(seq.guess_pause == 0 for seq in self._guessing_decodes())

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        done_groups = set()
        guessing = set(self._guessing_decodes())
        wanted: list[tuple[ScheduledSeq, int]] = []  # decodes that guess, and how many guesses at most
        # Decodes before prefill chunks, so that a long prompt cannot starve the batch.
        for seq in sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1):
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            if wanted and seq.num_tokens - seq.num_computed_tokens > 1:  # the decodes are done: the
                budget += self._propose(wanted)  # chunks get the budget that guesses left over
                wanted = []
            group = seq.beam_group
            if group is not None:
                if id(group) not in done_groups:
                    done_groups.add(id(group))
                    budget = self._schedule_beam_group(out, group, budget)
                continue
            n = self._tokens_for(seq, budget)
            if n == 0:
                continue
            if not self._grow_or_preempt(seq, seq.num_computed_tokens + n, out):
                continue
            item = ScheduledSeq(seq, n, seq.num_computed_tokens)
            out.scheduled.append(item)
            limit = self._guess_limit(seq, budget) if seq in guessing else 0
            if limit:
                wanted.append((item, limit))
            budget -= n + limit
        return budget + self._propose(wanted)

    def _propose(self, wanted: list[tuple[ScheduledSeq, int]]) -> int:
        """One call for every guessing decode (a draft model decodes their guesses as one batch);
        returns the token budget held for guesses that were not made. A proposer that fails costs
        the step its guesses, not its requests."""
        wanted = [(item, limit) for item, limit in wanted if item.seq.status is SequenceStatus.RUNNING]
        if not wanted:
            return 0
        try:
            drafts = self.proposer.propose_all([(item.seq, limit) for item, limit in wanted])
        except Exception:  # noqa: BLE001 - e.g. a draft model out of memory: plain decoding goes on
            logger.exception("speculation failed this step; the step runs without guesses")
            drafts = [[] for _ in wanted]
            for item, _ in wanted:
                item.seq.draft_kv_tokens = 0  # whatever the draft wrote is not trusted
                self.proposer.missed(item.seq)
        unused = 0
        for (item, limit), draft in zip(wanted, drafts):
            item.draft = draft
            item.num_tokens += len(draft)
            unused += limit - len(draft)
        return unused

    def _guess_limit(self, seq: Sequence, budget: int) -> int:
        """How many guesses a decode whose own token is scheduled may carry: no more than the token
        budget, the request's max_tokens and the KV slots allow (0: none this step)."""
        if seq.guess_pause:  # a step without guessing, overlapped
            seq.guess_pause -= 1
            return 0
        if seq.pending_row is not None:  # planned while its last token is still on the device
            return 0
        limit = min(self.proposer.max_draft_len, budget - 1, seq.params.max_tokens - seq.num_output_tokens - 1,
                    self._slots_for_guesses(seq))
        return max(limit, 0)  # no room this step is not a miss

    def _slots_for_guesses(self, seq: Sequence) -> int:
        """KV slots guesses may take. Under GUARANTEED_NO_EVICT the sequence's blocks up to its
        max_tokens are reserved already, so a guess may take the next block early. Under
        MAX_UTILIZATION a guess never takes a new block: one it took could make a later sequence
        evict, or push a cached prefix out of the pool."""
        held = len(seq.block_table) * self.blocks.block_size - (seq.num_computed_tokens + 1)
        if self.limits.policy is SchedulerPolicy.MAX_UTILIZATION:
            return held
        wanted = min(seq.num_computed_tokens + 1 + self.proposer.max_draft_len, seq.max_total_tokens)
        return wanted - (seq.num_computed_tokens + 1) if self.blocks.ensure_slots(seq, wanted) else held

    def _schedule_beam_group(self, out: SchedulerOutput, group, budget: int) -> int:
        """Beams advance in lockstep: all of a group's sequences in one step, or none."""
        seqs = group.running
        plans = [(s, self._tokens_for(s, budget)) for s in seqs]
        total = sum(n for _, n in plans)
        if any(n == 0 for _, n in plans) or total > budget:
            return budget
        for seq, n in plans:
            if not self._grow_or_preempt(seq, seq.num_computed_tokens + n, out):
                return budget  # blocks already grown stay with their sequences for the next step
        out.scheduled.extend(ScheduledSeq(seq, n, seq.num_computed_tokens) for seq, n in plans)
        return budget - total

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        while not self.blocks.ensure_slots(seq, num_tokens):
            if self.limits.policy is SchedulerPolicy.GUARANTEED_NO_EVICT:
                return False  # cannot happen while reservations hold; wait rather than evict
            victim = self._pick_victim()
            if victim is None:
                return False
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _pick_victim(self) -> Sequence | None:
        for seq in reversed(self.running):  # the latest arrival loses its place first
            if seq.beam_group is None:
                return seq
        return None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute later: drop the KV (reuse may bring it back) and queue at the front."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = seq.draft_kv_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preempted_total += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        # The running sequences' reservation (_reservation) is summed once a pass and kept up to date
        # as sequences are admitted: summed per admission, it walked every running sequence each time.
        reserved: int | None = None
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_batch_size:
            seq = self.waiting[0]
            width = seq.params.beam_width
            if len(self.running) + width > self.limits.max_batch_size:
                break
            n = self._tokens_for(seq, budget)
            if n == 0 or not self._adapter_fits(seq):
                break  # first come, first served: no overtaking
            if self._admits_whole(seq):
                reserved = self._reservation() if reserved is None else reserved
                need = self.blocks.blocks_needed_to_admit(seq, seq.max_total_tokens) * width
                if need > self.blocks.num_free_blocks - reserved:
                    break
            elif not self._first_chunk_fits(seq, budget):
                break
            self.waiting.popleft()
            self.blocks.allocate_cached_prefix(seq)
            n = self._tokens_for(seq, budget)  # cached prefix blocks shorten the work
            assert self.blocks.ensure_slots(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens))
            budget -= n
            if reserved is not None and seq.beam_group is not None:
                reserved = None  # a beam group's beams share blocks: summed again when next needed
            elif reserved is not None:
                reserved += self._still_to_claim(seq)  # what _reservation would now count for it

    def _adapter_fits(self, seq: Sequence) -> bool:
        if seq.adapter_id is None:
            return True
        active = {s.adapter_id for s in self.running if s.adapter_id is not None}
        return seq.adapter_id in active or len(active) < self.limits.max_loras

    def _admits_whole(self, seq: Sequence) -> bool:
        """Whether `seq` is admitted only once every block it may need is free beside what the
        running sequences may still claim; otherwise once its first chunk fits."""
        return (self.limits.policy is SchedulerPolicy.GUARANTEED_NO_EVICT
                or seq.params.beam_width > 1 or self.limits.batching is BatchingType.STATIC)

    def _first_chunk_fits(self, seq: Sequence, budget: int) -> bool:
        cached = self.blocks.cached_prefix_tokens(seq)  # the first chunk starts after the cached prefix
        first_chunk = min(seq.num_tokens - cached, budget)
        return self.blocks.blocks_needed_to_admit(seq, cached + first_chunk) <= self.blocks.num_free_blocks

    def _still_to_claim(self, seq: Sequence) -> int:
        return max(0, self.blocks.blocks_for(seq.max_total_tokens) - len(seq.block_table))

    def _reservation(self) -> int:
        """Blocks the running sequences may still claim before they finish."""
        reserved, seen_groups = 0, set()
        for seq in self.running:
            group = seq.beam_group
            if group is None:
                reserved += self._still_to_claim(seq)
            elif id(group) not in seen_groups:
                seen_groups.add(id(group))
                held = len({block for s in group.running for block in s.block_table})  # forks share blocks
                reserved += max(0, group.width * self.blocks.blocks_for(seq.max_total_tokens) - held)
        return reserved
