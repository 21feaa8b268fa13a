"""Rank 0's side of the model: turns a scheduler plan into step inputs, has every rank run them,
and samples the next tokens from the logits."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from app.engine.config import EngineConfig
from app.engine.draft_model import DraftModelProposer
from app.engine.executor import ProcessLauncher, WorkerLauncher, cpu_threads_per_rank
from app.engine.guided import warm_up_bitmask_kernel
from app.engine.lora_loader import LoRAAdapter
from app.engine.model_loader import read_model_config
from app.engine.parallel import Distributed, ParallelLayout
from app.engine.sampler import DeviceSample, Sampler, SamplerOutput, prompt_logprobs
from app.engine.scheduler import ScheduledSeq, SchedulerOutput
from app.engine.sequence import Sequence
from app.engine.transfer import list_to_device, to_device
from app.engine.worker import ModelShard, RankCommand, StepInputs


@dataclass
class PromptRows:
    """Logits rows of prompt positions whose logprobs or logits a request asks for (prompt_logprobs,
    return_context_logits): each row's sequence and the prompt token after it, which the row
    scores, in prompt order. The prompt's last position is its sampling row, not one of these."""
    seqs: list[Sequence] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    at: list[int] = field(default_factory=list)  # where each row is among its batch's logits

    def extend(self, other: PromptRows, offset: int) -> None:
        self.seqs += other.seqs
        self.targets += other.targets
        self.at += [offset + i for i in other.at]


@dataclass
class StepResult:
    seqs: list[Sequence]  # the sequences that sampled, aligned with the sampler's rows
    sampled: SamplerOutput
    # prompt rows' (sequence, logprob of the next prompt token, likeliest (ids, logprobs) or None)
    prompt_logprobs: list[tuple[Sequence, float, tuple[list[int], list[float]] | None]] = \
        field(default_factory=list)
    # return_context_logits: (sequence, its next prompt rows' raw logits, float32 [rows, vocab])
    context_logits: list[tuple[Sequence, np.ndarray]] = field(default_factory=list)


@dataclass
class ForwardPass:
    """A step's forward pass, queued on the device."""
    logits: torch.Tensor
    seqs: list[Sequence]  # the sampling rows' sequences, in row order
    prompt: PromptRows
    forward_at: float  # time.monotonic() when its first kernel was queued
    busy: bool  # the step before was still computing then


@dataclass
class LaunchedStep:
    """A step queued on the device whose tokens have not been read back yet (overlapped steps).
    Its sampling may be queued later than its forward pass (`ModelRunner.sample`): until then
    `sample` is None and `logits` holds the forward pass's rows."""
    plan: SchedulerOutput
    seqs: list[Sequence]  # aligned with the sample's rows
    sample: DeviceSample | None = None
    logits: torch.Tensor | None = None
    forward_at: float = 0.0  # time.monotonic() when its inputs were ready and its first kernel was queued
    # Its first kernel queued while the step before still computed, and its sampling with it: the
    # device ran the two back to back, so the time between their ends is this step's (StepClock).
    back_to_back: bool = False


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, max_seq_len: int,
                 launcher: WorkerLauncher | None = None):
        layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size, rank=0)
        self.dist, self.launcher = None, None
        device = config.device
        if layout.world_size > 1:
            cfg = read_model_config(model_dir)  # refuse a split the model cannot take before starting ranks
            layout.check_model(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.num_layers)
            self.launcher = launcher or ProcessLauncher()
            self.dist = self._start_workers(config, model_dir, max_seq_len, layout)
            device = self.launcher.device(0, config.device)
        try:
            # A draft model loads first: the target's KV pool, sized from what is free, leaves room
            # for the draft's, block for block (app/engine/draft_model.py).
            spec = config.speculative_config
            self.draft = DraftModelProposer(config, max_seq_len, torch.device(device),
                                            read_model_config(model_dir).vocab_size) \
                if spec is not None and spec.drafts_with_model else None
            self.shard = ModelShard(config, model_dir, max_seq_len, torch.device(device), self.dist,
                                    self.draft.kv_bytes_per_token if self.draft else 0,
                                    self.draft.graph_bytes if self.draft else 0)
            if self.draft is not None:
                self.draft.allocate(self.shard.num_blocks)
        except BaseException:
            if self.dist is not None:  # the other ranks may wait on rank 0 forever: end them
                self.launcher.stop()
                self.dist.close()
            raise
        self.sampler = Sampler(config.seed, self.shard.device)
        if self.shard.device.type == "cuda":  # no guided step waits for the mask kernel's compile
            warm_up_bitmask_kernel(self.shard.device, self.shard.model.config.vocab_size)

    # Rank 0's shard holds the device, the KV pool and the adapters; the engine reads them here.
    @property
    def device(self) -> torch.device:
        return self.shard.device

    @property
    def num_blocks(self) -> int:
        return self.shard.num_blocks

    @property
    def block_size(self) -> int:
        return self.shard.block_size

    @property
    def loras(self):
        return self.shard.loras

    def _start_workers(self, config: EngineConfig, model_dir: Path, max_seq_len: int,
                       layout: ParallelLayout) -> Distributed:
        init_method = self.launcher.rendezvous()
        threads = cpu_threads_per_rank(layout.world_size)
        for rank in range(1, layout.world_size):
            self.launcher.start(rank, dict(
                config=config, model_dir=str(model_dir), max_seq_len=max_seq_len,
                layout=ParallelLayout(layout.tp_size, layout.pp_size, rank), init_method=init_method,
                device=self.launcher.device(rank, config.device), cpu_threads=threads))
        if config.device == "cpu":
            torch.set_num_threads(threads)
        return Distributed(layout, init_method, torch.device(self.launcher.device(0, config.device)))

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Run the step and read its tokens back, and the prompt logprobs and raw logits rows its
        requests owe."""
        forward = self._run(plan)
        logits, seqs, prompt = forward.logits, forward.seqs, forward.prompt
        if not prompt.seqs:
            result = StepResult(seqs, self.sampler(logits, seqs))
        else:
            at = list_to_device(prompt.at, logits.device)
            sampling = to_device(torch.ones(len(logits), dtype=torch.bool), logits.device)
            sampling[at] = False
            scored = prompt_logprobs(logits[at], prompt.targets, [s.params.prompt_logprobs or 0 for s in prompt.seqs])
            result = StepResult(seqs, self.sampler(logits[sampling], seqs),
                                [(seq, value, top) for seq, (value, top) in zip(prompt.seqs, scored)])
        if any(s.params.returns_logits for s in seqs + prompt.seqs):
            self._take_logits(logits, prompt, result)
        return result

    @staticmethod
    def _take_logits(logits: torch.Tensor, prompt: PromptRows, result: StepResult) -> None:
        """The raw rows that requests asking for logits are owed, read back in one copy: context
        rows (prompt rows, then the prompt's last row, which samples the first token) and each
        sampling row's generation row (the same last row, for the first token)."""
        scored = set(prompt.at)
        sample_at = [i for i in range(len(logits)) if i not in scored]  # aligned with result.seqs
        context: dict[Sequence, list[int]] = {}
        for seq, i in zip(prompt.seqs, prompt.at):
            if seq.params.return_context_logits:
                context.setdefault(seq, []).append(i)
        for seq, i in zip(result.seqs, sample_at):
            if seq.samples_last_context_row:
                context.setdefault(seq, []).append(i)
        generation = [(row, i) for row, (seq, i) in enumerate(zip(result.seqs, sample_at))
                      if seq.params.return_generation_logits]
        wanted = [i for rows in context.values() for i in rows] + [i for _, i in generation]
        if not wanted:
            return
        host = logits[list_to_device(wanted, logits.device)].float().cpu().numpy()
        start = 0
        for seq, rows in context.items():  # copies: a row kept never holds the step's others
            result.context_logits.append((seq, host[start:start + len(rows)].copy()))
            start += len(rows)
        for row, _ in generation:
            result.sampled.logits[row] = host[start].copy()
            start += 1

    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput, previous: LaunchedStep | None, sample: bool = True) -> LaunchedStep:
        """Queue the step on the device and return without waiting for it. Inputs that are tokens
        of `previous` still on the device (Sequence.pending_row) are read there. One rank only.
        `sample=False` queues the forward pass alone: `sample` queues the rest once the host has
        what sampling needs (guided rows: their grammars advanced by `previous`'s tokens)."""
        # A guess follows the sequence's last token on the host: a step with guesses never overlaps.
        assert not any(item.draft for item in plan.scheduled), "a step with guesses was launched overlapped"
        forward = self._run(plan, previous.sample if previous is not None else None)
        assert not forward.prompt.seqs, "a step computing prompt logprobs is never overlapped"
        launched = LaunchedStep(plan, forward.seqs, logits=forward.logits, forward_at=forward.forward_at,
                                back_to_back=forward.busy and sample)
        if sample:
            self.sample(launched)
        return launched

    @torch.inference_mode()
    def sample(self, launched: LaunchedStep) -> None:
        """Queue a launched step's sampling."""
        launched.sample = self.sampler.sample(launched.logits, launched.seqs)
        launched.logits = None

    def _run(self, plan: SchedulerOutput, previous: DeviceSample | None = None) -> ForwardPass:
        """Queue the step's forward pass, its decode inputs read from `previous`'s tokens where pending."""
        groups = self._micro_batches(plan.scheduled)
        prepared = [self._prepare(group) for group in groups]
        batches = [inputs for inputs, _, _ in prepared]
        if self.dist is not None:
            self.dist.broadcast((RankCommand.STEP, plan.block_copies, batches))
        forward_at, busy = time.monotonic(), previous is not None and not previous.done()
        logits = self.shard.execute(plan.block_copies, batches, previous.token_ids if previous is not None else None)
        prompt, offset = PromptRows(), 0
        for inputs, _, rows in prepared:  # the logits of each batch follow the batch before's
            prompt.extend(rows, offset)
            offset += len(inputs.logits_indices)
        seqs = [seq for _, group_seqs, _ in prepared for seq in group_seqs]
        return ForwardPass(logits, seqs, prompt, forward_at, busy)

    def add_lora(self, name: str, path, in_use: set[str], prepared: LoRAAdapter | None = None) -> None:
        """`prepared`: rank 0's LoRACache.prepare of it, done already (off the engine loop). The other
        ranks prepare their shards when they receive the command."""
        # prepare raises for a bad adapter before any other rank sees it
        self.loras.add(name, prepared or self.loras.prepare(name, path), in_use)
        if self.dist is not None:
            self.dist.broadcast((RankCommand.ADD_LORA, name, path, in_use))

    def shutdown(self) -> None:
        self.sampler.shutdown()
        if self.dist is not None:
            self.dist.broadcast((RankCommand.STOP,))
            self.launcher.stop()
            self.dist.close()
            self.dist = None

    def _micro_batches(self, scheduled: list[ScheduledSeq]) -> list[list[ScheduledSeq]]:
        """One batch, or with pipeline stages up to one per stage, so the stages overlap."""
        stages = self.shard.layout.pp_size
        count = max(1, min(stages, len(scheduled)))
        size = -(-len(scheduled) // count)
        return [scheduled[i:i + size] for i in range(0, len(scheduled), size)]

    def _prepare(self, scheduled: list[ScheduledSeq]) -> tuple[StepInputs, list[Sequence], PromptRows]:
        """Pack the tokens: decodes first (batched attention), then prefill chunks. A decode that
        carries guesses is a decode row per token, each seeing the context up to itself: the rows
        of one sequence write their KV before any row attends, so each sees those before it.
        Logits rows stay in row order (a decode-only batch's graph returns every row, in order):
        a chunk's prompt rows come before its sampling row, the prompt's last, whose logits are
        the first output token's."""
        bs = self.block_size
        decodes, prefills = [], []
        for item in scheduled:
            (decodes if item.is_decode else prefills).append(item)
        tokens, positions, slots, sample_seqs, logits_indices = [], [], [], [], []
        pending: list[int] = []  # input rows whose token is still on the device, and the rows of
        pending_from: list[int] = []  # the previous step's tokens they take
        lora_rows: dict[str, list[int]] = {}
        chunks, prompt = [], PromptRows()
        for i, item in enumerate(decodes + prefills):
            seq, start, n = item.seq, item.start, item.num_tokens
            end, first = start + n, len(tokens)
            if n == 1:  # most rows of a busy step (a plain decode): the general case (else), unrolled
                tokens.append(seq.token_ids[start])
                positions.append(start)
                slots.append(seq.block_table[start // bs] * bs + start % bs)
            else:
                tokens.extend(seq.token_ids[start:end - len(item.draft)] + item.draft)
                positions.extend(range(start, end))
                slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
            if seq.adapter_id is not None:
                lora_rows.setdefault(seq.adapter_id, []).extend(range(first, first + n))
            if i >= len(decodes):  # a prefill chunk
                chunks.append((first, n, end, seq.block_table[:-(-end // bs)]))
            if seq.needs_prompt_rows:  # rows not scored yet (a recompute after preemption skips those that were)
                for p in range(max(start, len(seq.prompt_logprobs)), min(end, seq.num_prompt_tokens - 1)):
                    prompt.seqs.append(seq)
                    prompt.targets.append(seq.token_ids[p + 1])
                    prompt.at.append(len(logits_indices))
                    logits_indices.append(first + p - start)
            if item.draft:  # every row's token is checked
                sample_seqs.extend([seq] * n)
                logits_indices.extend(range(first, first + n))
            elif item.samples:
                sample_seqs.append(seq)
                logits_indices.append(first + n - 1)
            if seq.pending_row is not None and end == seq.num_tokens:
                pending.append(first + n - 1)
                pending_from.append(seq.pending_row)
        decode_tables = decode_lens = None
        tables = [s.seq.block_table for s in decodes for _ in range(s.num_tokens)]  # a row each
        if tables:  # the decode rows come first: their context lengths are their positions + 1
            decode_tables = torch.from_numpy(_padded(tables))
            decode_lens = torch.from_numpy(np.asarray(positions[:len(tables)], dtype=np.int32) + 1)
        inputs = StepInputs(_longs(tokens), _longs(positions), _longs(slots), len(tables),
                            decode_tables, decode_lens, chunks, _longs(logits_indices),
                            lora_rows, _longs(pending + pending_from).view(2, -1) if pending else None)
        return inputs, sample_seqs, prompt


def _longs(values: list[int]) -> torch.Tensor:
    """An int64 tensor of a list (numpy reads a list of ints several times faster than torch.tensor)."""
    return torch.from_numpy(np.fromiter(values, np.int64, len(values)))


def _padded(rows: list[list[int]]) -> np.ndarray:
    """The rows as one int32 array, each padded with 0 to the longest."""
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    packed = np.zeros((len(rows), int(lengths.max())), np.int32)
    packed[np.arange(packed.shape[1]) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(rows), np.int32, int(lengths.sum()))
    return packed
