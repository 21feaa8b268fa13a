"""Turns the logits of one step into tokens, vectorized over the batch with per-row parameters.

Order: constraints (min_tokens, bad words), penalties, then temperature, top-k, top-p, min-p and a
draw by the exponential race (argmax p / Exp(1)), which takes each row's own seeded generator.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from app.engine.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row; -1 for beam-search rows
    logprobs: list[float]
    # beam-search rows: the best 2 * beam_width (log-prob, token) continuations, best first
    beam_candidates: dict[int, tuple[list[float], list[int]]] = field(default_factory=dict)


class DeviceSample:
    """A step's sampled tokens and their logprobs, still where they were computed. On CUDA they are
    copied into pinned host memory behind the step, so reading them back waits for this step alone,
    not for a later one queued after it."""

    def __init__(self, token_ids: torch.Tensor, logprobs: torch.Tensor):
        self.token_ids = token_ids  # [rows] on the device: the next step's inputs can be read from here
        self._ready = None
        if token_ids.is_cuda:
            self._host_tokens = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self._host_logprobs = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)
            self._host_tokens.copy_(token_ids, non_blocking=True)
            self._host_logprobs.copy_(logprobs, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host_tokens, self._host_logprobs = token_ids, logprobs

    def result(self) -> SamplerOutput:
        """Waits for the step (the engine's one host sync per step)."""
        if self._ready is not None:
            self._ready.synchronize()
        return SamplerOutput(self._host_tokens.tolist(), self._host_logprobs.tolist())


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device).manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Sample and read the tokens back; beam-search rows get their candidates instead."""
        constrained = self._apply_constraints(logits, seqs)
        beams = [i for i, seq in enumerate(seqs) if seq.beam_group is not None]
        out = self._draw(logits, constrained, seqs).result()
        for i in beams:
            width = seqs[i].beam_group.width
            values, ids = torch.log_softmax(constrained[i], dim=-1).topk(2 * width)
            out.beam_candidates[i] = (values.tolist(), ids.tolist())
            out.token_ids[i] = -1
        return out

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> DeviceSample:
        """Sample without waiting for the device (no beam-search rows), for overlapped steps."""
        return self._draw(logits, self._apply_constraints(logits, seqs), seqs)

    def _draw(self, raw: torch.Tensor, logits: torch.Tensor, seqs: list[Sequence]) -> DeviceSample:
        """Each row's token (beam rows: a dummy 0) and its logprob under the raw logits. Host lists
        reach the device by non-blocking copies only, so nothing here waits for the step."""
        device = logits.device
        greedy = [i for i, seq in enumerate(seqs) if seq.beam_group is None and seq.params.greedy]
        sample = [i for i, seq in enumerate(seqs) if seq.beam_group is None and not seq.params.greedy]
        if len(greedy) == len(seqs):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.zeros(len(seqs), dtype=torch.long, device=device)
            if greedy:
                rows = _on(device, greedy)
                tokens[rows] = logits[rows].argmax(dim=-1)
            if sample:
                rows = _on(device, sample)
                tokens[rows] = self._sample(logits[rows], [seqs[i] for i in sample])
        chosen = torch.log_softmax(raw, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        return DeviceSample(tokens, chosen)

    def _apply_constraints(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        copied = False
        for i, seq in enumerate(seqs):
            p = seq.params
            banned = []
            # A guided output ends when its grammar says so: min_tokens does not hold its end back.
            if seq.num_output_tokens < p.min_tokens and not p.ignore_eos and seq.grammar is None:
                banned.extend(seq.eos_ids)
            for bad in p.bad_token_ids:
                if len(bad) == 1 or seq.token_ids[len(seq.token_ids) - len(bad) + 1:] == bad[:-1]:
                    banned.append(bad[-1])
            if not banned and not p.needs_penalties and seq.grammar is None:
                continue
            if not copied:
                logits, copied = logits.clone(), True
            if seq.grammar is not None:
                allowed = seq.grammar.allowed(logits.shape[-1]).to(logits.device, non_blocking=True)
                logits[i].masked_fill_(~allowed, float("-inf"))
            if p.needs_penalties:
                _apply_penalties(logits[i], seq)
            if banned:
                logits[i, banned] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        device = logits.device
        temps = _on(device, [s.params.temperature for s in seqs])
        logits = logits / temps[:, None]
        truncate = any(s.params.top_k > 0 or s.params.top_p < 1.0 or s.params.min_p > 0.0 for s in seqs)
        index = None
        if truncate:
            logits, index = logits.sort(dim=-1, descending=True)
            logits = _truncate_sorted(logits, seqs)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for i, seq in enumerate(seqs):
            noise[i].exponential_(generator=seq.generator or self.generator)
        choice = (probs / noise).argmax(dim=-1)
        return choice if index is None else index.gather(1, choice[:, None]).squeeze(1)


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
    ks = _on(device, [s.params.top_k or vocab for s in seqs])
    logits = logits.masked_fill(torch.arange(vocab, device=device)[None, :] >= ks[:, None], float("-inf"))
    top_p = _on(device, [s.params.top_p for s in seqs])
    probs = logits.softmax(dim=-1)
    logits = logits.masked_fill(probs.cumsum(dim=-1) - probs > top_p[:, None], float("-inf"))
    min_p = _on(device, [s.params.min_p for s in seqs])
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < min_p[:, None] * probs[:, :1], float("-inf"))


def _on(device: torch.device, values: list) -> torch.Tensor:
    """A host list on the device without a sync (`torch.tensor(..., device=cuda)` waits for the stream)."""
    return torch.tensor(values).to(device, non_blocking=True)
