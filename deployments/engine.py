"""The engine stage: one replica owns one engine and runs its loop continuously."""
from __future__ import annotations

import os

import torch
from ray import serve

from app.config import ServiceConfig
from app.engine import AsyncLLMEngine, SamplingParams
from app.engine.llm_engine import merge_outputs
from app.streaming import StreamPacer


@serve.deployment(name="Engine")
class EngineDeployment:
    def __init__(self, config: ServiceConfig):
        if config.device == "cpu":
            torch.set_num_threads(config.cpu_threads or os.cpu_count())
        self.engine = AsyncLLMEngine(config.engine_config())
        self.pacer = StreamPacer(config.serve.engine.stream_interval_ms)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       adapter_id: str | None = None):
        """Stream RequestOutput deltas, coalesced by time; cancelling the stream aborts the request."""
        source = self.engine.generate(request_id, prompt_token_ids, params, adapter_id)
        async for output in self.pacer.pace(source, merge_outputs):
            yield output

    def stats(self) -> dict:
        stats = self.engine.stats()
        return {**vars(stats), "kv_cache_hit_rate": stats.kv_cache_hit_rate, "healthy": self.engine.healthy}

    def check_health(self) -> None:
        if not self.engine.healthy:
            raise RuntimeError("engine loop is dead")
