"""One rank's share of the model: its weights, KV cache, LoRA cache and CUDA graphs, and the forward
pass of a step (StepInputs, prepared by rank 0). Ranks other than 0 run `worker_main`.

Without parallelism the engine's process holds the only shard. With tensor x pipeline parallelism
every rank holds one; rank 0 broadcasts each step's inputs, every rank runs its layers, pipeline
stages hand hidden states on, and the last stage sends the logits back to rank 0, which samples.
"""
from __future__ import annotations

import enum
import faulthandler
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import torch

from app.engine.config import EngineConfig
from app.engine.cuda_graphs import DecodeGraphs
from app.engine.lora import LoRACache, LoRASlots
from app.engine.model_loader import load_model
from app.engine.models.attention import FP8, AttentionMetadata, PackedPrefills
from app.engine.parallel import SINGLE, Distributed, ParallelLayout
from app.engine.piecewise_graphs import PiecewiseGraphs
from app.engine.transfer import to_device
from app.heap import freeze_startup_heap


class RankCommand(enum.Enum):
    """What rank 0 broadcasts to the other ranks of a parallel engine."""

    STEP = "step"
    ADD_LORA = "add_lora"
    STOP = "stop"


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def resolve_kv_dtype(kv_dtype: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's element type: the model's, or E4M3 for kv_cache_config.dtype fp8."""
    if kv_dtype == "auto":
        return dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("kv_cache_config.dtype fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper): "
                         "the Triton kernels that write and read it convert to E4M3 there only")
    return FP8


@dataclass
class StepInputs:
    """One (micro-)batch of a step, on the host: decode tokens first, then prefill chunks."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor  # cache slot each token writes
    num_decodes: int
    decode_tables: torch.Tensor | None  # [num_decodes, max_blocks] int32
    decode_lens: torch.Tensor | None  # [num_decodes] int32 context lengths
    prefills: list[tuple[int, int, int, list[int]]]  # (start, num_tokens, context_len, block table)
    logits_indices: torch.Tensor  # rows that sample
    lora_rows: dict[str, list[int]] = field(default_factory=dict)
    pending: torch.Tensor | None = None  # [2, n]: input rows, and the previous step's token rows they take


class ModelShard:
    def __init__(self, config: EngineConfig, model_dir: Path, max_seq_len: int, device: torch.device,
                 dist: Distributed | None = None, shared_kv_bytes_per_token: int = 0, reserved_bytes: int = 0):
        """`shared_kv_bytes_per_token`: another pool's bytes per token that this pool's size must
        leave room for, block for block, and `reserved_bytes` other memory to leave free (a draft
        model's pool and decode graphs, app/engine/draft_model.py)."""
        self.device, self.dist = device, dist
        self.layout = dist.layout if dist else ParallelLayout()
        tp = dist.tp if dist else SINGLE
        self.dtype = resolve_dtype(config.dtype, device)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_config.dtype, self.dtype, device)
        self.model = load_model(model_dir, self.dtype, device, max_seq_len, config.load_format, self.layout, tp,
                                config.quantization)
        self.block_size = config.kv_cache_config.tokens_per_block
        cfg = self.model.config
        shapes = self.model.lora_shapes(cfg)
        # On CUDA adapters live in fixed slots, reserved before the KV pool takes what is free.
        slots = LoRASlots(self.model, config.max_loras, config.max_lora_rank,
                          {self.model.PROJECTIONS[p][0] for p in shapes}, self.dtype) \
            if device.type == "cuda" and config.max_loras else None
        self.loras = LoRACache(config.max_loras, config.max_cpu_loras, config.max_lora_rank, device, self.dtype,
                               shapes, cfg.num_layers, self.layout.tp_size, self.layout.tp_rank, slots)
        self.graphs, self.piecewise, self.kv_cache = None, None, None  # step_bytes runs a step before them
        sized = config.kv_cache_config.max_tokens is None
        taken = self.step_bytes(config, max_seq_len) + self.graph_bytes(config, max_seq_len) if sized else 0
        num_blocks = self._count_blocks(config, max_seq_len, taken + reserved_bytes, shared_kv_bytes_per_token)
        self.allocate_pool(dist.min_int(num_blocks) if dist else num_blocks, config, max_seq_len)  # every rank the same
        if device.type == "cuda":
            self._warm_up(config, max_seq_len)

    def _captures(self, config: EngineConfig) -> bool:
        # Pipeline stages pass activations between graphs; only single-stage decode is captured.
        return (self.device.type == "cuda" and config.cuda_graphs and self.layout.pp_size == 1
                and self.model.graph_capturable())

    def allocate_pool(self, num_blocks: int, config: EngineConfig, max_seq_len: int) -> None:
        """A pool of `num_blocks` (in place of any before it: a draft model's pool matches its
        target's, which is sized after the draft's weights load), and the graphs over it."""
        self.graphs, self.piecewise, self.kv_cache = None, None, None
        self.num_blocks = num_blocks
        self._allocate_cache(num_blocks)
        if self._captures(config):
            self.graphs, self.piecewise = self._capture(config, max_seq_len)

    def _allocate_cache(self, num_blocks: int) -> None:
        cfg = self.model.config
        # One block more than the pool hands out: the scratch block padded graph rows write to.
        self.kv_cache = torch.zeros(len(self.model.layers), 2, num_blocks + 1, self.block_size,
                                    cfg.num_kv_heads // self.layout.tp_size, cfg.head_dim, dtype=self.kv_dtype,
                                    device=self.device)

    def _capture(self, config: EngineConfig, max_seq_len: int) -> tuple[DecodeGraphs, PiecewiseGraphs | None]:
        num_blocks = self.kv_cache.shape[2] - 1
        kv_caches = list(self.kv_cache.unbind(0))
        decode = DecodeGraphs(self.model, kv_caches, config.max_batch_size, -(-max_seq_len // self.block_size),
                              num_blocks, self.block_size, self.device, self.loras.slots)
        max_tokens = min(config.piecewise_graph_max_tokens, config.max_num_tokens)
        if max_tokens <= 0:
            return decode, None
        return decode, PiecewiseGraphs(self.model, kv_caches, max_tokens, num_blocks * self.block_size, self.dtype,
                                       self.device, self.loras.slots)

    @torch.inference_mode()
    def _largest_step(self, config: EngineConfig, max_seq_len: int) -> None:
        """The step of the most tokens the scheduler forms: max_num_tokens of new prompts, none longer
        than max_seq_len, all writing the scratch block (their keys are never read again), with
        logits for as many rows as a batch samples. Not measured by it: the sampler's own memory, a
        chunk gathering a long cached prefix, adapter rows; the fraction's remainder covers those."""
        n, bs = config.max_num_tokens, self.block_size
        sizes = [min(max_seq_len, n - start) for start in range(0, n, max_seq_len)]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        scratch = self.kv_cache.shape[2] - 1
        batch = StepInputs(torch.zeros(n, dtype=torch.long), torch.cat([torch.arange(size) for size in sizes]),
                           scratch * bs + torch.arange(n) % bs, 0, None, None,
                           [(start, size, size, []) for start, size in zip(starts, sizes)],
                           torch.arange(max(0, n - config.max_batch_size), n))
        hidden = None if self.layout.is_first_stage else torch.zeros(
            n, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
        self._forward(batch, hidden)
        torch.cuda.synchronize(self.device)

    def step_bytes(self, config: EngineConfig, max_seq_len: int) -> int:
        """Device memory the largest step takes beyond the weights: its activations as the allocator
        holds them, measured over a one-block cache (0 off CUDA; one-time allocations of a first
        forward, such as cuBLAS's workspace, count too). The KV pool is sized from what is free once
        this is set aside, as TensorRT-LLM's pool is sized after its activation buffers: a pool that
        took it would run out of memory at the first long prefill."""
        if self.device.type != "cuda":
            return 0
        self._allocate_cache(1)
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self._largest_step(config, max_seq_len)
        taken = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.kv_cache = None
        torch.cuda.empty_cache()
        return max(0, taken)

    def _warm_up(self, config: EngineConfig, max_seq_len: int) -> None:
        """Run the largest step once over the real pool before serving (from the piecewise graphs
        where they take it): its kernels load here and the allocator keeps its memory, rather than
        in the first burst's first long prefill (python -m tools.bench.bursts)."""
        try:
            self._largest_step(config, max_seq_len)
        except torch.OutOfMemoryError as exc:
            raise RuntimeError(f"a step of max_num_tokens ({config.max_num_tokens}) does not fit beside a KV pool "
                               f"of {self.num_blocks * self.block_size} tokens: lower kv_cache_config.max_tokens "
                               "or max_num_tokens") from exc

    def graph_bytes(self, config: EngineConfig, max_seq_len: int) -> int:
        """Device memory the graphs take (decode and piecewise: their pools and the activations of their
        warm-ups; 0 where none are captured), measured by capturing them once over a one-block cache, so that
        a KV pool is sized from what is free once the graphs are in place. The graphs are captured
        again over the real pool, which replaces the one this shard had."""
        if not self._captures(config):
            return 0
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self._allocate_cache(1)
        graphs = self._capture(config, max_seq_len)
        taken = free_before - torch.cuda.mem_get_info(self.device)[0]
        del graphs
        self.kv_cache = None
        torch.cuda.empty_cache()
        return max(0, taken)

    def _count_blocks(self, config: EngineConfig, max_seq_len: int, graph_bytes: int,
                      shared_kv_bytes_per_token: int) -> int:
        kv = config.kv_cache_config
        if kv.max_tokens is not None:
            return -(-kv.max_tokens // self.block_size)
        tokens = int(self._free_memory(graph_bytes) * kv.free_gpu_memory_fraction) // (
            self.kv_bytes_per_token + shared_kv_bytes_per_token)
        if self.device.type != "cuda":  # no card to fill: never more than a full batch can use
            tokens = min(tokens, config.max_batch_size * max_seq_len)
        return max(1, tokens // self.block_size)

    def _free_memory(self, graph_bytes: int) -> int:
        """Bytes the KV pool takes its fraction of: on CUDA what the weights, adapter slots and graphs
        left; on CPU this rank's share of free RAM."""
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0] - graph_bytes
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // self.layout.world_size

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's keys and values on this rank, every layer: an FP8 cache's half of bf16's."""
        cfg = self.model.config
        return (2 * len(self.model.layers) * cfg.num_kv_heads // self.layout.tp_size * cfg.head_dim
                * self.kv_dtype.itemsize)

    @property
    def returns_logits(self) -> bool:
        return self.layout.rank == 0

    @torch.inference_mode()
    def execute(self, block_copies: list[tuple[int, int]], batches: list[StepInputs],
                previous_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run the step's micro-batches through this rank's layers; rank 0 gets the logits
        [sampling rows, vocab], in batch order, every other rank None. `previous_tokens` (one rank
        only): the tokens of the step before, still on the device, that `pending` inputs take."""
        for src, dst in block_copies:
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        if self.layout.pp_size == 1:
            logits = self._forward(batches[0], previous_tokens=previous_tokens)
            return logits if self.returns_logits else None
        return self._pipeline(batches)

    def _forward(self, batch: StepInputs, hidden: torch.Tensor | None = None,
                 previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        input_ids, positions, meta, logits_indices = self._to_device(batch)
        if batch.pending is not None:
            pending = to_device(batch.pending, self.device)
            input_ids[pending[0]] = previous_tokens[pending[1]]
        decode_only = meta.num_decodes == len(input_ids) == len(logits_indices)
        if (self.graphs is not None and decode_only and len(input_ids) <= self.graphs.max_batch_size
                and (not batch.lora_rows or self.graphs.with_lora)):
            return self.graphs.run(input_ids, positions, meta, self.loras, batch.lora_rows)
        if (self.piecewise is not None and len(input_ids) <= self.piecewise.max_tokens
                and (not batch.lora_rows or self.piecewise.with_lora)):
            return self.piecewise.run(input_ids, positions, meta, logits_indices, self.loras, batch.lora_rows)
        kv_caches = list(self.kv_cache.unbind(0))
        return self.model(input_ids, positions, kv_caches, meta, logits_indices,
                          self.loras.batch(batch.lora_rows, len(input_ids)), hidden)

    def _pipeline(self, batches: list[StepInputs]) -> torch.Tensor | None:
        """Micro-batches flow stage to stage: while stage s runs batch i, stage s - 1 runs batch i + 1."""
        dist, cfg = self.dist, self.model.config
        pending, logits = [], []
        for batch in batches:
            hidden = None
            if not self.layout.is_first_stage:
                hidden = dist.recv_prev_stage((len(batch.input_ids), cfg.hidden_size), self.dtype)
            out = self._forward(batch, hidden)
            if not self.layout.is_last_stage:
                pending.append(dist.send_next_stage(out))
            elif self.returns_logits:
                logits.append(out)
            elif self.layout.tp_rank == 0:
                pending.append(dist.send_to_driver(out))
        if self.returns_logits and not self.layout.is_last_stage:
            logits = [dist.recv_from_last_stage((len(b.logits_indices), cfg.vocab_size), torch.float32)
                      for b in batches]
        for work in pending:
            work.wait()
        return torch.cat(logits) if self.returns_logits else None

    def _to_device(self, batch: StepInputs):
        """The step's inputs on the device, by copies that do not wait for the step already queued
        (app/engine/transfer.py)."""
        dev, bs = self.device, self.block_size

        def on_device(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else to_device(t, dev)
        prefills = PackedPrefills.build(batch.prefills, bs, dev) if batch.prefills else None
        meta = AttentionMetadata(on_device(batch.slots), batch.num_decodes, on_device(batch.decode_tables),
                                 on_device(batch.decode_lens), prefills)
        return on_device(batch.input_ids), on_device(batch.positions), meta, on_device(batch.logits_indices)


def worker_main(config: EngineConfig, model_dir: str, max_seq_len: int, layout: ParallelLayout, init_method: str,
                device: str, cpu_threads: int) -> None:
    """A rank other than 0: build its shard, then run what rank 0 broadcasts until told to stop."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` prints where a rank waits
    if device == "cpu":
        torch.set_num_threads(cpu_threads)
    dist = Distributed(layout, init_method, torch.device(device))
    try:
        shard = ModelShard(config, Path(model_dir), max_seq_len, torch.device(device), dist)
        freeze_startup_heap()  # app/heap.py: a full collection here would hold up every rank's collectives
        while run_command(shard, *dist.broadcast()):
            pass
    finally:
        dist.close()


def run_command(shard: ModelShard, command: RankCommand, *args) -> bool:
    """Do what rank 0 broadcast; False when told to stop."""
    if command is RankCommand.STEP:
        shard.execute(*args)
    elif command is RankCommand.ADD_LORA:
        name, path, in_use = args
        shard.loras.add(name, shard.loras.prepare(name, path), in_use)
    elif command is RankCommand.STOP:
        return False
    else:  # a rank that skipped a command would fall out of step with rank 0 for good
        raise ValueError(f"rank {shard.layout.rank}: unknown command {command!r} from rank 0")
    return True
