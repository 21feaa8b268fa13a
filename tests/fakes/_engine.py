"""What both fakes run underneath: the portable engine on the model directory they are given."""
from __future__ import annotations

from app.engine import AsyncLLMEngine, EngineConfig, KvCacheConfig, SchedulerPolicy


def start_engine(model_dir: str, max_batch_size: int = 64, max_num_tokens: int = 2048, max_seq_len: int | None = None,
                 max_beam_width: int = 4, enable_block_reuse: bool = True, tokens_per_block: int = 32,
                 max_tokens: int | None = None, policy: str = "GUARANTEED_NO_EVICT", max_loras: int = 8,
                 max_cpu_loras: int = 64, max_lora_rank: int = 64, chunked: bool = True) -> AsyncLLMEngine:
    config = EngineConfig(model=model_dir, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                          max_seq_len=max_seq_len, max_beam_width=max_beam_width, enable_chunked_prefill=chunked,
                          scheduler_policy=SchedulerPolicy(policy.upper()),
                          kv_cache_config=KvCacheConfig(enable_block_reuse=enable_block_reuse,
                                                        tokens_per_block=tokens_per_block,
                                                        max_tokens=max_tokens or 16384),
                          max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=max_lora_rank)
    return AsyncLLMEngine(config)
