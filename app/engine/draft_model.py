"""Draft-target speculation: a smaller model with the target's tokenizer guesses the next tokens.

The draft model decodes each guessing sequence's guesses greedily, one batch for every guessing
sequence of the step and one forward pass per guess position, then the target checks them all in
its step (app/engine/speculative.py: greedy guesses are a point-mass draft, so the acceptance rule
there keeps sampled requests' distributions). Sampling the draft from its own distribution, with
the q-aware acceptance rule, would stand more guesses of sampled requests; not built.

The draft's KV pool mirrors the target's block for block: the same block ids, the same block
tables, a smaller pool per block (fewer, narrower layers). So the draft needs no block manager of
its own, and its KV lives exactly as long as the sequence's blocks. A sequence's draft KV holds its
tokens for its first `draft_kv_tokens` positions: the scheduler cuts that to the confirmed tokens
when the target checks the guesses, and to 0 when the sequence is preempted (its blocks go).
Each proposal first catches the draft up from there to the last known token (one row for a
decode that took every guess, a chunk after a miss, a pause or on first use), then decodes a
guess per pass. The guesses' KV slots are the target's: the scheduler holds the slots of
every guess before asking, and the draft writes one position fewer than the target checks.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from app.engine.config import EngineConfig
from app.engine.model_loader import read_model_config, resolve_model_dir
from app.engine.sequence import Sequence
from app.engine.speculative import Proposer
from app.engine.worker import ModelShard, StepInputs


class DraftModelProposer(Proposer):
    def __init__(self, config: EngineConfig, max_seq_len: int, device: torch.device, target_vocab_size: int):
        """Loads the draft's weights (with a one-block pool): the target's pool is sized after them,
        leaving room per block for the draft's (`kv_bytes_per_token`), and `allocate` follows."""
        spec = config.speculative_config
        self.max_draft_len = spec.max_draft_len
        model_dir = resolve_model_dir(spec.speculative_model)
        draft_cfg = read_model_config(model_dir)
        if draft_cfg.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config.speculative_model's vocabulary ({draft_cfg.vocab_size} tokens) "
                             f"differs from the model's ({target_vocab_size}): the draft must share its tokenizer")
        self.max_seq_len = min(max_seq_len, draft_cfg.max_seq_len)
        kv = config.kv_cache_config
        # Guessing decodes carry max_draft_len + 1 rows each within max_batch_size (Scheduler._guessing_decodes).
        # No adapters, no quantization: the draft is the plain model, whatever the target's requests adapt.
        self.config = replace(config, model=str(model_dir), quantization=None, max_loras=0,
                              max_batch_size=max(1, config.max_batch_size // (spec.max_draft_len + 1)),
                              speculative_config=None, tensor_parallel_size=1, pipeline_parallel_size=1)
        one_block = replace(self.config, cuda_graphs=False, kv_cache_config=replace(kv, max_tokens=kv.tokens_per_block))
        # Built for the target's context (its block tables), guessing only within the draft's own.
        self.target_max_seq_len = max_seq_len
        self.shard = ModelShard(one_block, model_dir, max_seq_len, device)
        self.block_size = kv.tokens_per_block

    @property
    def kv_bytes_per_token(self) -> int:
        return self.shard.kv_bytes_per_token

    def allocate(self, num_blocks: int) -> None:
        """The pool, as many blocks as the target's, and the draft's decode graphs over it."""
        self.shard.resize_pool(num_blocks, self.config, self.target_max_seq_len)

    @torch.inference_mode()
    def propose_all(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in wanted]
        # A guess the draft would write past its own context limit is not asked for.
        limits = [min(limit, self.max_seq_len - seq.num_tokens + 1) for seq, limit in wanted]
        rows = [i for i, limit in enumerate(limits) if limit > 0]
        if not rows:
            return drafts
        tokens = self._catch_up([wanted[i][0] for i in rows])
        for i, token in zip(rows, tokens):
            drafts[i].append(token)
        for step in range(1, max(limits)):
            rows = [i for i in rows if limits[i] > step]
            tokens = self._decode([wanted[i][0] for i in rows], [drafts[i][-1] for i in rows], step)
            for i, token in zip(rows, tokens):
                drafts[i].append(token)
        for (seq, _), draft in zip(wanted, drafts):
            if draft:  # every guess but the last went through the draft
                seq.draft_kv_tokens = seq.num_tokens + len(draft) - 1
        return drafts

    def _catch_up(self, seqs: list[Sequence]) -> list[int]:
        """The draft's KV from its valid positions to the sequence's last token, and its first guess:
        a decode row where one token is missing, a prefill chunk otherwise (decodes first)."""
        starts = [seq.draft_kv_tokens for seq in seqs]
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].num_tokens - starts[i] > 1)
        decodes = [i for i in order if seqs[i].num_tokens - starts[i] == 1]
        spans = [(seqs[i], starts[i], seqs[i].num_tokens) for i in order]
        batch = self._inputs(spans, [seqs[i].token_ids[starts[i]:] for i in order], len(decodes))
        by_order = self._next_tokens(batch)
        tokens = [0] * len(seqs)
        for i, token in zip(order, by_order):
            tokens[i] = token
        return tokens

    def _decode(self, seqs: list[Sequence], last_guesses: list[int], step: int) -> list[int]:
        """One more guess each: the previous guess in at the position after the last one's."""
        spans = [(seq, seq.num_tokens - 1 + step, seq.num_tokens + step) for seq in seqs]
        return self._next_tokens(self._inputs(spans, [[t] for t in last_guesses], len(seqs)))

    def _inputs(self, spans: list[tuple[Sequence, int, int]], tokens: list[list[int]], num_decodes: int) -> StepInputs:
        """A batch of rows at positions [start, end) of each sequence, over the sequence's block table:
        the first `num_decodes` spans one row each, the rest prefill chunks; each span's last row samples."""
        bs = self.block_size
        ids, positions, slots, chunks, sample_rows = [], [], [], [], []
        for k, ((seq, start, end), span_tokens) in enumerate(zip(spans, tokens)):
            if k >= num_decodes:
                chunks.append((len(ids), end - start, end, seq.block_table[:-(-end // bs)]))
            ids.extend(span_tokens)
            positions.extend(range(start, end))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
            sample_rows.append(len(ids) - 1)
        tables = lens = None
        if num_decodes:
            decodes = [seq for seq, _, _ in spans[:num_decodes]]
            width = max(len(seq.block_table) for seq in decodes)
            tables = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq in decodes],
                                  dtype=torch.int32)
            lens = torch.tensor([end for _, _, end in spans[:num_decodes]], dtype=torch.int32)
        return StepInputs(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), num_decodes, tables,
                          lens, chunks, torch.tensor(sample_rows, dtype=torch.long))

    def _next_tokens(self, batch: StepInputs) -> list[int]:
        logits = self.shard.execute([], [batch])
        return logits.argmax(dim=-1).tolist()  # the one wait per pass: the next pass feeds these in
