"""The portable PyTorch engine (app/engine) behind the engine protocol: the default backend."""
from __future__ import annotations

import asyncio
from contextlib import aclosing

import torch

from app.backends.base import AdapterTable
from app.config import ServiceConfig
from app.engine import AsyncLLMEngine, InvalidRequestError, LLMEngine, SamplingParams
from app.engine.errors import AdapterNotLoadedError
from app.engine.cpu_team import on_passing_thread
from app.engine.engine_process import EngineProcess
from app.engine.executor import WorkerLauncher, cpu_threads_per_rank
from app.protocol.messages import AdapterRef


class TorchBackend:
    name = "torch"

    def __init__(self, config: ServiceConfig, adapters: dict[str, str], launcher: WorkerLauncher | None = None):
        one_cpu_rank = config.device == "cpu" and config.world_size == 1
        threads = (config.cpu_threads or cpu_threads_per_rank(1)) if one_cpu_rank else None
        self.adapters = AdapterTable()
        for name, path in adapters.items():
            self.adapters.register(name, path)
        self._loading: dict[str, asyncio.Future] = {}  # adapter name -> its load in flight
        if config.runs_engine_process:  # a broken adapter stops start-up there, with its reason
            self.engine = EngineProcess(config.engine_config(), adapters, config.step_timeout_s, threads)
            return
        if threads:  # parallel ranks split the cores among them
            torch.set_num_threads(threads)

        def build() -> LLMEngine:
            engine = LLMEngine(config.engine_config(), launcher)
            for name, path in adapters.items():  # before the loop starts: a broken adapter stops start-up
                engine.add_lora(name, path)
            return engine
        # Not on this thread, which lives on: the loop's OpenMP team must be the only one (app/engine/cpu_team.py).
        self.engine = AsyncLLMEngine(config.engine_config(), engine=on_passing_thread(build),
                                     step_timeout_s=config.step_timeout_s)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       adapter: AdapterRef | None = None):
        if adapter is None:
            async for output in self.engine.generate(request_id, prompt_token_ids, params):
                yield output
            return
        # The engine may evict the adapter before the request reaches it: the stats that said it was
        # loaded are a step old, and another request's load may come first. Loaded again, it is
        # kept for this request (LLMEngine.FRESH_LOAD_S).
        for again in (False, True):
            await self._load(adapter, again)
            async with aclosing(self.engine.generate(request_id, prompt_token_ids, params, adapter.name)) as outputs:
                try:
                    first = await anext(outputs)
                except AdapterNotLoadedError:
                    if again:
                        raise InvalidRequestError(adapter.field, f"LoRA adapter '{adapter.name}' was evicted "
                                                                 "twice before its request started; retry") from None
                    continue
                yield first
                async for output in outputs:
                    yield output
                return

    async def _load(self, adapter: AdapterRef, again: bool = False) -> None:
        """Bind the name (at once, before any await: two first uses cannot race to two paths) and
        load it where the engine does not hold it: its first use, or after the host cache evicted it,
        from the path it was bound to. Concurrent first uses share one load (each would read and
        fold the adapter again, and re-registering drops its device copy); a caller that goes away
        does not cancel it for the others."""
        new = adapter.name not in self.adapters.paths
        _, path = self.adapters.resolve(adapter)
        if self.engine.has_lora(adapter.name) and not again:
            return
        loading = self._loading.get(adapter.name)
        if loading is None:
            loading = self._loading[adapter.name] = asyncio.ensure_future(self.engine.add_lora(adapter.name, path))
            loading.add_done_callback(lambda done: self._loaded(adapter.name, path, new, done))
        await asyncio.shield(loading)

    def _loaded(self, name: str, path: str, bound_by_it: bool, done: asyncio.Future) -> None:
        """A load ended (before any of its callers resumes). One that failed unbinds the name its
        first use bound, whoever still waits, so that the name can be sent again with a good path."""
        self._loading.pop(name, None)
        failed = done.cancelled() or done.exception() is not None  # retrieved: every caller may be gone
        if failed and bound_by_it and self.adapters.paths.get(name) == path:
            self.adapters.unregister(name)

    async def add_lora(self, name: str, path: str) -> None:
        await self._load(AdapterRef(name, path, "lora_adapters"))

    def stats(self) -> dict:
        stats = self.engine.stats()
        return {**vars(stats), "kv_cache_hit_rate": stats.kv_cache_hit_rate, "healthy": self.healthy}

    @property
    def healthy(self) -> bool:
        return self.engine.healthy

    def shutdown(self) -> None:
        self.engine.shutdown()
