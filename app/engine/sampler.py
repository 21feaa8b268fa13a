"""Turns the logits of one step into tokens, vectorized over the batch with per-row parameters.

Order: logit_bias, constraints (min_tokens, bad words), penalties, then temperature, top-k, top-p,
min-p and a draw by the exponential race (argmax p / Exp(1)), which takes each row's own seeded
generator. Logprobs (the chosen token's, and the top_logprobs likeliest of rows that ask) are taken
from the raw logits, before any of it (SamplingParams says why).
"""
from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from app.engine.guided import GrammarMatcher, apply_bitmask, fill_bitmask, new_bitmask
from app.engine.sequence import Sequence
from app.engine.stream_gate import StreamGate
from app.engine.transfer import list_to_device


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row; -1 for beam-search rows
    logprobs: list[float]
    # beam-search rows: the best 2 * beam_width (log-prob, token) continuations, best first
    beam_candidates: dict[int, tuple[list[float], list[int]]] = field(default_factory=dict)
    # rows whose request asks for top_logprobs: (token ids, logprobs) of the likeliest, best first
    top_logprobs: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    # rows whose request asks for return_generation_logits: the row's raw logits, float32 [vocab]
    # (filled by ModelRunner.execute: such requests never step overlapped)
    logits: dict[int, np.ndarray] = field(default_factory=dict)
    # rows of a seeded sequence that samples several rows (guesses): its generator's state after the
    # row's draw, for the scheduler to rewind to once it knows how many rows it took (speculative.py)
    generator_states: dict[int, torch.Tensor] = field(default_factory=dict)


class DeviceSample:
    """A step's sampled tokens and their logprobs, still where they were computed. On CUDA they are
    copied into pinned host memory behind the step, so reading them back waits for this step alone,
    not for a later one queued after it. `top` is (rows, how many each asks for, their top-k
    logprobs and token ids), for the rows that ask for top_logprobs; it travels the same way.
    `masks`: the fill of the step's guided masks where it runs behind a gate (Sampler._mask)."""

    def __init__(self, token_ids: torch.Tensor, logprobs: torch.Tensor,
                 top: tuple[list[int], list[int], torch.Tensor, torch.Tensor] | None = None,
                 generator_states: dict[int, torch.Tensor] | None = None, masks: Future | None = None):
        self._masks = masks
        self.token_ids = token_ids  # [rows] on the device: the next step's inputs can be read from here
        self.generator_states = generator_states or {}  # host tensors already (SamplerOutput's)
        self._ready = None
        self.finished_at: float | None = None  # time.monotonic() the device finished it, where result() waited for that
        self._top_rows, self._top_counts, *top_tensors = top or ([], [])
        tensors = [token_ids, logprobs, *top_tensors]
        self._host = tensors
        if token_ids.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, t in zip(self._host, tensors):
                host.copy_(t, non_blocking=True)
            self._ready = torch.cuda.Event(enable_timing=True)  # the step clock times steps by their ends
            self._ready.record()

    def done(self) -> bool:
        """Whether the device has computed the step (off CUDA it has, when launched)."""
        return self._ready is None or self._ready.query()

    def device_seconds_since(self, earlier: DeviceSample) -> float | None:
        """Device time from the end of `earlier` to the end of this step, both read back (CUDA only)."""
        if self._ready is None or earlier._ready is None:
            return None
        return earlier._ready.elapsed_time(self._ready) / 1000.0

    def result(self) -> SamplerOutput:
        """Waits for the step (the engine's one host sync per step)."""
        if self._masks is not None:  # first: the stream waits for it, and a fill that failed raises here
            self._masks.result()
        if self._ready is not None and not self._ready.query():
            self._ready.synchronize()
            self.finished_at = time.monotonic()
        tokens, logprobs, *top = (t.tolist() for t in self._host)
        out = SamplerOutput(tokens, logprobs, generator_states=self.generator_states)
        for row, count, values, ids in zip(self._top_rows, self._top_counts, *top):
            out.top_logprobs[row] = (ids[:count], values[:count])
        return out


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device).manual_seed(seed)
        # On CUDA a guided step's sampling is queued at once, behind a gate that its masks' fill
        # opens from a thread of its own: the host goes on to the next step while xgrammar fills.
        self._gate = StreamGate.for_device(device)
        self._fills = ThreadPoolExecutor(1, thread_name_prefix="guided-masks") if self._gate else None

    def shutdown(self) -> None:
        """Fills queued already run to the end (each opens its gate)."""
        if self._fills is not None:
            self._fills.shutdown(wait=True)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Sample and read the tokens back; beam-search rows get their candidates instead."""
        constrained, masks = self._apply_constraints(logits, seqs)
        beams = [i for i, seq in enumerate(seqs) if seq.beam_group is not None]
        out = self._draw(logits, constrained, masks, seqs).result()
        for i in beams:
            width = seqs[i].beam_group.width
            values, ids = torch.log_softmax(constrained[i], dim=-1).topk(2 * width)
            out.beam_candidates[i] = (values.tolist(), ids.tolist())
            out.token_ids[i] = -1
        return out

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> DeviceSample:
        """Sample without waiting for the device (no beam-search rows), for overlapped steps."""
        return self._draw(logits, *self._apply_constraints(logits, seqs), seqs)

    def _draw(self, raw: torch.Tensor, logits: torch.Tensor, masks: Future | None,
              seqs: list[Sequence]) -> DeviceSample:
        """Each row's token (beam rows: a dummy 0) and its logprob under the raw logits, and the
        top_logprobs of the rows that ask (top-k over those rows alone: no cost for the others).
        Host lists reach the device by non-blocking copies only, so nothing here waits for the step."""
        device = logits.device
        states = {}
        greedy = [i for i, seq in enumerate(seqs) if seq.beam_group is None and seq.params.greedy]
        sample = [i for i, seq in enumerate(seqs) if seq.beam_group is None and not seq.params.greedy]
        if len(greedy) == len(seqs):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.zeros(len(seqs), dtype=torch.long, device=device)
            if greedy:
                rows = list_to_device(greedy, device)
                tokens[rows] = logits[rows].argmax(dim=-1)
            if sample:
                rows = list_to_device(sample, device)
                tokens[rows], drawn = self._sample(logits[rows], [seqs[i] for i in sample])
                states = {sample[i]: state for i, state in drawn.items()}
        raw_logprobs = torch.log_softmax(raw, dim=-1)
        chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
        asking = [i for i, seq in enumerate(seqs) if seq.params.top_logprobs]
        if not asking:
            return DeviceSample(tokens, chosen, generator_states=states, masks=masks)
        counts = [seqs[i].params.top_logprobs for i in asking]
        values, ids = raw_logprobs[list_to_device(asking, device)].topk(max(counts), dim=-1)
        return DeviceSample(tokens, chosen, (asking, counts, values, ids), states, masks)

    def _apply_constraints(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, Future | None]:
        """The logits the draw sees: a copy where anything changes them, so that `logits` stays raw;
        and the fill of the guided rows' masks where it runs on a thread (`_mask`)."""
        copied = False
        biased = [(i, seq.params.logit_bias) for i, seq in enumerate(seqs) if seq.params.logit_bias]
        if biased:  # one gather and scatter for every biased row of the batch; a row's ids are distinct
            logits, copied = logits.clone(), True
            rows = list_to_device([i for i, bias in biased for _ in bias], logits.device)
            cols = list_to_device([token for _, bias in biased for token in bias], logits.device)
            logits[rows, cols] += list_to_device([value for _, bias in biased for value in bias.values()], logits.device)
        # A sequence that ended since this step was planned (overlapped) keeps a row nobody reads.
        guided = [i for i, seq in enumerate(seqs) if seq.grammar is not None and not seq.is_finished]
        masks = None
        if guided:
            if not copied:
                logits, copied = logits.clone(), True
            masks = self._mask(logits, [seqs[i].grammar for i in guided], guided)
        for i, seq in enumerate(seqs):
            p = seq.params
            banned = []
            if seq.num_output_tokens < p.min_tokens and not p.ignore_eos:  # never guided (validate_request)
                banned.extend(seq.eos_ids)
            for bad in p.bad_token_ids:
                if len(bad) == 1 or seq.token_ids[len(seq.token_ids) - len(bad) + 1:] == bad[:-1]:
                    banned.append(bad[-1])
            if not banned and not p.needs_penalties:
                continue
            if not copied:
                logits, copied = logits.clone(), True
            if p.needs_penalties:
                _apply_penalties(logits[i], seq)
            if banned:
                logits[i, banned] = float("-inf")
        return logits, masks

    def _mask(self, logits: torch.Tensor, matchers: list[GrammarMatcher], rows: list[int]) -> Future | None:
        """-inf in `rows` of the logits where their grammars rule a token out: one bitmask filled on
        the host, one copy, one kernel. With a gate, the fill goes to the fills' thread, which opens
        the gate once it is done, and what reads the masks is queued behind the gate; the Future is
        the fill. `rows` ascend: the bitmask stops at the last."""
        bitmask = new_bitmask(rows[-1] + 1, matchers[0].vocab_size, pin=logits.is_cuda)
        if self._gate is None:
            fill_bitmask(matchers, bitmask, rows)
            apply_bitmask(logits, bitmask.to(logits.device, non_blocking=True), rows)
            return None
        ticket = self._gate.close()
        try:  # the opener first: anything below that waits for the device then waits for the fill alone
            fill = self._fills.submit(self._fill_then_open, matchers, bitmask, rows, ticket)
        except BaseException:  # the fills' thread has stopped (shut down): nothing else will open it
            self._gate.open(ticket)
            raise
        # Pinned: the copy reads the host's words when the stream reaches it, past the gate.
        apply_bitmask(logits, bitmask.to(logits.device, non_blocking=True), rows)
        return fill

    def _fill_then_open(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int],
                        ticket: int) -> None:
        try:
            fill_bitmask(matchers, bitmask, rows)
        finally:
            self._gate.open(ticket)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """A draw from each row's distribution, and for the rows of a seeded sequence that has
        several (guesses) its generator's state after the row's draw: reading it is host-only
        (a CUDA generator's seed and offset live on the host), nothing waits for the device."""
        device = logits.device
        temps = list_to_device([s.params.temperature for s in seqs], device)
        logits = logits / temps[:, None]
        truncate = any(s.params.top_k > 0 or s.params.top_p < 1.0 or s.params.min_p > 0.0 for s in seqs)
        index = None
        if truncate:
            logits, index = logits.sort(dim=-1, descending=True)
            logits = _truncate_sorted(logits, seqs)
        probs = logits.softmax(dim=-1)
        noise, states = self._noise(probs, seqs)
        if index is not None:
            # Drawn in vocabulary order, then sorted with the probabilities: a row's token never
            # depends on whether another row in the batch truncates (which sorts every row).
            noise = noise.gather(1, index)
        choice = (probs / noise).argmax(dim=-1)
        return (choice if index is None else index.gather(1, choice[:, None]).squeeze(1)), states

    def _noise(self, probs: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Exp(1) noise shaped like `probs`, and the generator states _sample returns. The rows of
        unseeded sequences share the engine's generator and one draw over the whole tensor (a
        launch per step, not per row); a seeded row then overwrites its own row with its sequence's
        generator, row by row in order, so its draws never depend on the rest of the batch."""
        seeded = [i for i, seq in enumerate(seqs) if seq.generator is not None]
        noise = torch.empty_like(probs)
        if len(seeded) < len(seqs):
            noise.exponential_(generator=self.generator)
        rows_of = Counter(seqs[i] for i in seeded)
        states = {}
        for i in seeded:
            noise[i].exponential_(generator=seqs[i].generator)
            if rows_of[seqs[i]] > 1:
                states[i] = seqs[i].generator.get_state()
        return noise, states


def prompt_logprobs(logits: torch.Tensor, targets: list[int], counts: list[int]
                    ) -> list[tuple[float, tuple[list[int], list[float]] | None]]:
    """Per row of prompt logits: the raw logprob of the prompt token that follows it (`targets`),
    and where its count is above 0 that many likeliest (ids, logprobs), best first. Reads back at
    once: steps that compute prompt rows are never overlapped (LLMEngine's Request.overlappable)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, list_to_device(targets, logits.device)[:, None]).squeeze(1).tolist()
    if not max(counts):
        return [(value, None) for value in chosen]
    values, ids = (t.tolist() for t in logprobs.topk(max(counts), dim=-1))
    return [(value, (row_ids[:k], row_values[:k]) if k else None)
            for value, row_ids, row_values, k in zip(chosen, ids, values, counts)]


def _apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
    p = seq.params
    if p.repetition_penalty != 1.0:  # transformers' RepetitionPenaltyLogitsProcessor
        seen = torch.tensor(sorted(set(seq.token_ids)), device=row.device)
        values = row[seen]
        row[seen] = torch.where(values < 0, values * p.repetition_penalty, values / p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
        counts = torch.bincount(torch.tensor(seq.output_token_ids, device=row.device), minlength=row.shape[0])
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _truncate_sorted(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """top-k, then top-p, then min-p, on logits sorted in descending order."""
    device, vocab = logits.device, logits.shape[-1]
    ks = list_to_device([s.params.top_k or vocab for s in seqs], device)
    logits = logits.masked_fill(torch.arange(vocab, device=device)[None, :] >= ks[:, None], float("-inf"))
    top_p = list_to_device([s.params.top_p for s in seqs], device)
    probs = logits.softmax(dim=-1)
    logits = logits.masked_fill(probs.cumsum(dim=-1) - probs > top_p[:, None], float("-inf"))
    min_p = list_to_device([s.params.min_p for s in seqs], device)
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < min_p[:, None] * probs[:, :1], float("-inf"))

