"""The engine stage: one replica owns one engine and runs its loop continuously."""
from __future__ import annotations

import os

import torch
from ray import serve

from app.adapters import AdapterPolicy
from app.config import ServiceConfig
from app.engine import AsyncLLMEngine, InvalidRequestError, LLMEngine, SamplingParams
from app.engine.llm_engine import merge_outputs
from app.protocol.messages import AdapterRef
from app.streaming import StreamPacer

MAX_ADAPTERS_PER_REPLICA = 64  # what Serve's multiplexed routing tracks per replica


@serve.deployment(name="Engine")
class EngineDeployment:
    def __init__(self, config: ServiceConfig):
        if config.device == "cpu":
            torch.set_num_threads(config.cpu_threads or os.cpu_count())
        engine = LLMEngine(config.engine_config())
        # Adapters named in the config load at start, so a broken one stops start-up with its reason.
        policy = AdapterPolicy(config.lora_roots, config.lora_adapters)
        self.adapter_paths = {name: policy.resolve(AdapterRef(name, None, "lora_adapters")).path
                              for name in config.lora_adapters}
        for name, path in self.adapter_paths.items():
            engine.add_lora(name, path)
        self.engine = AsyncLLMEngine(config.engine_config(), engine=engine, step_timeout_s=config.step_timeout_s)
        self.pacer = StreamPacer(config.serve.engine.stream_interval_ms)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       adapter: AdapterRef | None = None):
        """Stream RequestOutput deltas, coalesced by time; cancelling the stream aborts the request."""
        if adapter is not None:
            await self._load_adapter(adapter)
            await self._mark_resident(serve.get_multiplexed_model_id())
        source = self.engine.generate(request_id, prompt_token_ids, params, adapter.name if adapter else None)
        async for output in self.pacer.pace(source, merge_outputs):
            yield output

    async def _load_adapter(self, adapter: AdapterRef) -> None:
        if self.engine.has_lora(adapter.name) and adapter.path is None:
            return
        if adapter.path is None:
            raise InvalidRequestError(adapter.field, f"LoRA adapter '{adapter.name}' is not loaded on this server; "
                                                     "send lora_path (a directory under the configured lora_roots) "
                                                     "with the first request, then the name alone")
        if not self.engine.has_lora(adapter.name) or self.adapter_paths.get(adapter.name) != adapter.path:
            await self.engine.add_lora(adapter.name, adapter.path)
            self.adapter_paths[adapter.name] = adapter.path

    @serve.multiplexed(max_num_models_per_replica=MAX_ADAPTERS_PER_REPLICA)
    async def _mark_resident(self, name: str) -> str:
        """Tells Serve's router this replica holds the adapter, so its later requests come here."""
        return name

    def stats(self) -> dict:
        stats = self.engine.stats()
        loras = self.engine.engine.runner.loras
        return {**vars(stats), "kv_cache_hit_rate": stats.kv_cache_hit_rate, "healthy": self.engine.healthy,
                "lora": {"host": list(loras.host), "device": list(loras.on_device), "loads": loras.loads,
                         "evictions": loras.evictions, "hits": loras.hits, "misses": loras.misses}}

    def check_health(self) -> None:
        if not self.engine.healthy:
            raise RuntimeError("engine loop is dead")
