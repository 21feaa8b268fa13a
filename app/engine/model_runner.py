"""Owns the model and its KV cache on one device; turns a scheduler plan into sampled tokens."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from app.engine.config import EngineConfig
from app.engine.cuda_graphs import DecodeGraphs
from app.engine.lora import LoRACache
from app.engine.models.attention import AttentionMetadata, PrefillChunk
from app.engine.model_loader import load_model
from app.engine.sampler import Sampler, SamplerOutput
from app.engine.scheduler import SchedulerOutput
from app.engine.sequence import Sequence


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


@dataclass
class StepResult:
    seqs: list[Sequence]  # the sequences that sampled, aligned with the sampler's rows
    sampled: SamplerOutput


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, max_seq_len: int):
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model = load_model(model_dir, self.dtype, self.device, max_seq_len, config.load_format)
        self.block_size = config.kv_cache_config.tokens_per_block
        self.num_blocks = self._count_blocks(config, max_seq_len)
        cfg = self.model.config
        # One block more than the pool hands out: the scratch block padded graph rows write to.
        self.kv_cache = torch.zeros(cfg.num_layers, 2, self.num_blocks + 1, self.block_size, cfg.num_kv_heads,
                                    cfg.head_dim, dtype=self.dtype, device=self.device)
        self.sampler = Sampler(config.seed, self.device)
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        shapes = {"q_proj": (cfg.hidden_size, q), "k_proj": (cfg.hidden_size, kv), "v_proj": (cfg.hidden_size, kv),
                  "o_proj": (q, cfg.hidden_size), "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
                  "up_proj": (cfg.hidden_size, cfg.intermediate_size),
                  "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
        self.loras = LoRACache(config.max_loras, config.max_cpu_loras, config.max_lora_rank, self.device, self.dtype,
                               shapes)
        self.graphs = None
        if self.device.type == "cuda" and config.cuda_graphs:
            self.graphs = DecodeGraphs(self.model, list(self.kv_cache.unbind(0)), config.max_batch_size,
                                       -(-max_seq_len // self.block_size), self.num_blocks, self.block_size,
                                       self.device)

    def _count_blocks(self, config: EngineConfig, max_seq_len: int) -> int:
        kv = config.kv_cache_config
        if kv.max_tokens is not None:
            return -(-kv.max_tokens // self.block_size)
        cfg = self.model.config
        bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            tokens = int(free * kv.free_gpu_memory_fraction) // bytes_per_token
        else:  # no card to fill: a fraction of free RAM, but never more than a full batch can use
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            tokens = min(int(free * kv.free_gpu_memory_fraction) // bytes_per_token,
                         config.max_batch_size * max_seq_len)
        return max(1, tokens // self.block_size)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        for src, dst in plan.block_copies:
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        input_ids, positions, meta, sample_seqs, logits_indices, lora_rows = self._prepare(plan)
        decode_only = meta.num_decodes == len(input_ids) == len(sample_seqs) and not lora_rows
        if self.graphs is not None and decode_only and len(input_ids) <= self.graphs.max_batch_size:
            logits = self.graphs.run(input_ids, positions, meta)
        else:
            kv_caches = list(self.kv_cache.unbind(0))
            logits = self.model(input_ids, positions, kv_caches, meta, logits_indices,
                                self.loras.batch(lora_rows, len(input_ids)))
        return StepResult(sample_seqs, self.sampler(logits, sample_seqs))

    def _prepare(self, plan: SchedulerOutput):
        """Pack the step's tokens: decodes first (batched attention), then prefill chunks."""
        bs = self.block_size
        decodes = [s for s in plan.scheduled if s.num_tokens == 1]
        prefills = [s for s in plan.scheduled if s.num_tokens > 1]
        tokens, positions, sample_seqs, logits_indices = [], [], [], []
        lora_rows: dict[str, list[int]] = {}
        for item in decodes + prefills:
            start = item.seq.num_computed_tokens
            if item.seq.adapter_id is not None:
                lora_rows.setdefault(item.seq.adapter_id, []).extend(range(len(tokens), len(tokens) + item.num_tokens))
            if item.samples:
                sample_seqs.append(item.seq)
                logits_indices.append(len(tokens) + item.num_tokens - 1)
            tokens.extend(item.seq.token_ids[start:start + item.num_tokens])
            positions.extend(range(start, start + item.num_tokens))
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.long)
        slot_blocks = [s.seq.block_table[p // bs] for s in decodes + prefills
                       for p in range(s.seq.num_computed_tokens, s.seq.num_computed_tokens + s.num_tokens)]
        slots = torch.tensor(slot_blocks, dtype=torch.long) * bs + pos % bs
        decode_tables = decode_mask = decode_lens = None
        if decodes:
            width = max(len(s.seq.block_table) for s in decodes)
            decode_tables = torch.tensor([s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in decodes],
                                         dtype=torch.int32)
            context = torch.tensor([s.seq.num_computed_tokens + 1 for s in decodes], dtype=torch.int32)
            if dev.type == "cuda":  # the Triton kernel takes lengths, no mask
                decode_lens = context.to(dev, non_blocking=True)
            else:
                decode_mask = (torch.arange(width * bs)[None, :] < context[:, None])[:, None, None, :]
            decode_tables = decode_tables.to(dev)
        chunks, start = [], len(decodes)
        for item in prefills:
            context = item.seq.num_computed_tokens + item.num_tokens
            table = torch.tensor(item.seq.block_table[:-(-context // bs)], device=dev)
            chunks.append(PrefillChunk(start, item.num_tokens, context, table))
            start += item.num_tokens
        meta = AttentionMetadata(slots.to(dev), len(decodes), decode_tables, decode_mask, chunks, decode_lens)
        return (torch.tensor(tokens, device=dev), pos.to(dev), meta, sample_seqs,
                torch.tensor(logits_indices, dtype=torch.long, device=dev), lora_rows)
