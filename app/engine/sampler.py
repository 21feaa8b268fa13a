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


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device).manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_constraints(logits, seqs)
        rows = {"greedy": [], "sample": [], "beam": []}
        for i, seq in enumerate(seqs):
            kind = "beam" if seq.beam_group is not None else "greedy" if seq.params.greedy else "sample"
            rows[kind].append(i)
        tokens = torch.zeros(len(seqs), dtype=torch.long, device=logits.device)
        if rows["greedy"]:
            tokens[rows["greedy"]] = logits[rows["greedy"]].argmax(dim=-1)
        if rows["sample"]:
            tokens[rows["sample"]] = self._sample(logits[rows["sample"]], [seqs[i] for i in rows["sample"]])
        chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
        out = SamplerOutput(tokens.tolist(), chosen.tolist())
        for i in rows["beam"]:
            width = seqs[i].beam_group.width
            values, ids = torch.log_softmax(logits[i], dim=-1).topk(2 * width)
            out.beam_candidates[i] = (values.tolist(), ids.tolist())
            out.token_ids[i] = -1
        return out

    def _apply_constraints(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        copied = False
        for i, seq in enumerate(seqs):
            p = seq.params
            banned = []
            if seq.num_output_tokens < p.min_tokens and not p.ignore_eos:
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
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([s.params.temperature for s in seqs], device=device)
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
    ks = torch.tensor([s.params.top_k or vocab for s in seqs], device=device)
    logits = logits.masked_fill(torch.arange(vocab, device=device)[None, :] >= ks[:, None], float("-inf"))
    top_p = torch.tensor([s.params.top_p for s in seqs], device=device)
    probs = logits.softmax(dim=-1)
    logits = logits.masked_fill(probs.cumsum(dim=-1) - probs > top_p[:, None], float("-inf"))
    min_p = torch.tensor([s.params.min_p for s in seqs], device=device)
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < min_p[:, None] * probs[:, :1], float("-inf"))
