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
Each proposal first catches the draft up from there to the last known token (one row after a
step that rejected a guess, two after one that took them all: the last guess, which the draft never
fed itself, and the target's token after it; more after a pause or on first use, at most
max_num_tokens a proposal), then decodes a guess per pass. The guesses' KV slots are the
target's: the scheduler holds the slots of every guess before asking, and the draft writes one
position fewer than the target checks.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from app.engine.config import EngineConfig
from app.engine.model_dir import resolve_model_dir
from app.engine.model_loader import read_model_config
from app.engine.sequence import Sequence
from app.engine.speculative import Proposer
from app.engine.transfer import to_device
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
        # No adapters, no quantization: the draft is the plain model, whatever the target's requests
        # adapt. Its decode graphs take as many rows as the target's (a catch-up is a row a token).
        self.config = replace(config, model=str(model_dir), quantization=None, max_loras=0,
                              speculative_config=None, tensor_parallel_size=1, pipeline_parallel_size=1)
        one_block = replace(self.config, cuda_graphs=False, kv_cache_config=replace(kv, max_tokens=kv.tokens_per_block))
        # Built for the target's context (its block tables), guessing only within the draft's own.
        self.target_max_seq_len = max_seq_len
        self.shard = ModelShard(one_block, model_dir, max_seq_len, device)
        self.block_size = kv.tokens_per_block
        # What its decode graphs will take, for the target to leave free when it sizes its pool.
        self.graph_bytes = self.shard.graph_bytes(self.config, max_seq_len) if kv.max_tokens is None else 0

    def speculates(self, seq: Sequence) -> bool:
        return super().speculates(seq) and seq.num_tokens < self.max_seq_len  # within the draft's context

    @property
    def kv_bytes_per_token(self) -> int:
        return self.shard.kv_bytes_per_token

    def allocate(self, num_blocks: int) -> None:
        """The pool, as many blocks as the target's, and the draft's decode graphs over it."""
        self.shard.allocate_pool(num_blocks, self.config, self.target_max_seq_len)

    @torch.inference_mode()
    def propose_all(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in wanted]
        # A guess the draft would write past its own context limit is not asked for.
        limits = [min(limit, self.max_seq_len - seq.num_tokens + 1) for seq, limit in wanted]
        rows = [i for i, limit in enumerate(limits) if limit > 0]
        if not rows:
            return drafts
        # Catch-ups take at most max_num_tokens a proposal, in the step's sequence order (a long
        # prompt's first catch-up spreads over steps); one that does not reach the last token guesses
        # nothing this time, which is not a miss (no pause follows).
        seqs, budget, spans = [seq for seq, _ in wanted], self.config.max_num_tokens, []
        for i in rows:
            start = seqs[i].draft_kv_tokens
            end = min(seqs[i].num_tokens, start + budget)
            if end > start:
                spans.append((seqs[i], start, end))
                budget -= end - start
        if not spans:
            return drafts
        caught_up = self._next_tokens(spans, [seq.token_ids[start:end] for seq, start, end in spans])
        for seq, _, end in spans:
            seq.draft_kv_tokens = end
        rows = [i for i in rows if seqs[i].draft_kv_tokens == seqs[i].num_tokens]
        span_of = {seq: k for k, (seq, _, _) in enumerate(spans)}
        guesses = caught_up if len(rows) == len(spans) else caught_up[to_device(torch.tensor(
            [span_of[seqs[i]] for i in rows], dtype=torch.long), caught_up.device)]
        # Each pass takes the previous pass's guesses where they lie, on the device: the passes
        # queue back to back and the host waits once, for all of them, at the end.
        passes = [(rows, guesses)]
        for step in range(1, max((limits[i] for i in rows), default=0)):
            previous = {i: at for at, i in enumerate(rows)}
            rows = [i for i in rows if limits[i] > step]
            spans = [(seqs[i], seqs[i].num_tokens - 1 + step, seqs[i].num_tokens + step) for i in rows]
            guesses = self._next_tokens(spans, [[0] for _ in rows], (guesses, [previous[i] for i in rows]))
            passes.append((rows, guesses))
        for rows, guesses in passes:
            for i, token in zip(rows, guesses.tolist()):
                drafts[i].append(token)
        for seq, draft in zip(seqs, drafts):
            if draft:  # every guess but the last went through the draft
                seq.draft_kv_tokens = seq.num_tokens + len(draft) - 1
        return drafts

    def _next_tokens(self, spans: list[tuple[Sequence, int, int]], tokens: list[list[int]],
                     previous: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """The draft's greedy token after each span of positions [start, end) of its sequence, on the
        device. `previous`: one-token spans whose token is the previous pass's guess (its tensor, and
        which of its rows each span takes) in place of the placeholder in `tokens`."""
        batch, last_rows = self._inputs(spans, tokens)
        if previous is not None:
            batch.pending = torch.tensor([list(range(len(spans))), previous[1]], dtype=torch.long)
        logits = self.shard.execute([], [batch], previous[0] if previous is not None else None)
        return logits[to_device(torch.tensor(last_rows), logits.device)].argmax(dim=-1)

    def _inputs(self, spans: list[tuple[Sequence, int, int]], tokens: list[list[int]]) -> tuple[StepInputs, list[int]]:
        """The spans' tokens as a batch over their sequences' block tables, and which of its logits
        rows follows each span. Up to max_batch_size tokens in all, every token is a decode row of
        its own (the rows of a step write their KV before any row attends, as a target's guesses
        do), so a catch-up of a few tokens replays a decode graph too; past that, a span of several
        tokens is a prefill chunk (a first catch-up over a whole prompt)."""
        bs = self.block_size
        as_rows = sum(end - start for _, start, end in spans) <= self.config.max_batch_size
        order = sorted(range(len(spans)), key=lambda i: not as_rows and spans[i][2] - spans[i][1] > 1)
        ids, positions, slots, chunks, tables, lens, last_rows = [], [], [], [], [], [], [0] * len(spans)
        for i in order:  # decode rows first, then chunks
            seq, start, end = spans[i]
            assert start < end, "an empty span has no row to guess from"
            if as_rows or end - start == 1:
                tables += [seq.block_table] * (end - start)
                lens += range(start + 1, end + 1)
            else:
                chunks.append((len(ids), end - start, end, seq.block_table[:-(-end // bs)]))
            ids += tokens[i]
            positions += range(start, end)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
            last_rows[i] = len(ids) - 1
        # Logits come back for every decode row (a graph returns them all) and each chunk's last row.
        logits_rows = list(range(len(tables))) + [start + n - 1 for start, n, _, _ in chunks]
        last_rows = [logits_rows.index(row) for row in last_rows]
        width = max((len(t) for t in tables), default=0)
        batch = StepInputs(
            torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), len(tables),
            torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32) if tables else None,
            torch.tensor(lens, dtype=torch.int32) if tables else None, chunks, torch.tensor(logits_rows))
        return batch, last_rows
