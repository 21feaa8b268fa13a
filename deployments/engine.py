"""The engine stage: one replica owns one engine backend (torch, trtllm or triton) and streams its outputs."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from ray import serve
from ray.experimental import internal_kv

from app.adapters import AdapterPolicy
from app.backends import create_backend
from app.channel import Outbound, ReplyTo
from app.config import ServiceConfig
from app.engine import InvalidRequestError, SamplingParams
from app.engine.lora_loader import check_adapter_files
from app.engine.outputs import merge_outputs
from app.protocol.messages import AdapterRef
from deployments.metrics import EngineMetrics
from deployments.nodes import model_dir_on_this_node, placement_of_this_process
from deployments.workers import PlacementGroupLauncher

MAX_ADAPTERS_PER_REPLICA = 64  # what Serve's multiplexed routing tracks per replica
# Adapters that requests brought by path, for every replica of the app: a later request that names
# one alone and lands where it was never loaded (a restarted or new replica, a routing fallback)
# loads it from here. Ray's GCS key-value store outlives replicas and costs no process of its own.
ADAPTER_PATHS = "llm-serve-adapters"
logger = logging.getLogger("ray.serve")


def _rebound(adapter: AdapterRef) -> InvalidRequestError:
    return InvalidRequestError(adapter.field, f"LoRA adapter '{adapter.name}' is already bound to another path; "
                                              "send the new adapter under a new name", status=409)


@serve.deployment(name="Engine")
class EngineDeployment:
    def __init__(self, config: ServiceConfig):
        # Adapters named in the config register at start, so a broken one stops start-up with its reason.
        self.policy = AdapterPolicy(config.lora_roots, config.lora_adapters)
        adapters = {name: self.policy.resolve(AdapterRef(name, None, "lora_adapters")).path
                    for name in config.lora_adapters}
        model_dir_on_this_node(config.model, "the engine replica")  # the backend would say it without the node
        self.launcher = None
        if config.world_size > 1 and config.backend == "torch":
            self.launcher = PlacementGroupLauncher(config.device)
        self.backend = create_backend(config, adapters, self.launcher)
        self.app_name = serve.get_replica_context().app_name
        self.bound = dict(adapters)  # name -> path, for the names loaded here under the app's binding
        self.max_lora_rank = config.max_lora_rank
        # TensorRT-LLM reads adapters with its own loader, which takes forms ours refuses (fused
        # modules, modules_to_save): it alone checks what it loads.
        self.check_files = config.backend != "trtllm"
        self.outbound = Outbound(merge_outputs, config.serve.engine.stream_interval_ms)
        self.metrics = EngineMetrics(config.name, self.backend.stats)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       adapter: AdapterRef | None, reply_to: ReplyTo) -> None:
        """Send the request's RequestOutput deltas to `reply_to` (app/channel.py) and return once the
        last is written. Cancelling this call, or the consumer's death, aborts the request."""
        if adapter is not None:
            adapter = await self._bound(adapter)
            await self._mark_resident(serve.get_multiplexed_model_id())
        outputs = self.backend.generate(request_id, prompt_token_ids, params, adapter)
        await self.outbound.stream(reply_to, outputs)
        if adapter is not None and adapter.path is not None:
            self.bound[adapter.name] = adapter.path  # loaded here: its later requests skip the store

    async def _bound(self, adapter: AdapterRef) -> AdapterRef:
        """The adapter under the path this app binds its name to. A name keeps one path on every
        replica, for good: its first use with a path claims the name in Ray's key-value store before
        anything loads, and another path is then a 409. What can be checked without the model and
        the weights is checked before the claim, so that a name is not bound to a directory that is
        no adapter. A claim is never given back, even when the load fails later: freeing one safely
        would need to know that no replica serves it, and the name can always be sent again with the
        same path (after the files are mended) or a new name taken. A recorded path must still lie
        inside this app's lora_roots (the config may have changed since it was recorded)."""
        known = self.bound.get(adapter.name)
        if known is not None and adapter.path in (None, known):
            return adapter
        if known is not None:
            raise _rebound(adapter)
        key = self._key(adapter.name)
        try:
            if adapter.path is not None:  # resolved inside lora_roots by the Ingress
                if self.check_files:
                    await asyncio.to_thread(check_adapter_files, adapter.name, Path(adapter.path),
                                            self.max_lora_rank, "lora_path")
                existed = await asyncio.to_thread(internal_kv._internal_kv_put, key, adapter.path,
                                                  overwrite=False, namespace=ADAPTER_PATHS)
                if not existed:
                    return adapter
            recorded = await asyncio.to_thread(internal_kv._internal_kv_get, key, namespace=ADAPTER_PATHS)
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - unbound is safer than bound on this replica alone
            logger.warning("could not bind adapter %r in Ray's key-value store", adapter.name, exc_info=True)
            raise InvalidRequestError(adapter.field, f"LoRA adapter '{adapter.name}' could not be bound for the "
                                                     "app's replicas now; retry", status=503) from exc
        if recorded is None:
            return adapter
        recorded = recorded.decode()
        if adapter.path is not None and adapter.path != recorded:
            raise _rebound(adapter)
        return self.policy.resolve(AdapterRef(adapter.name, recorded, adapter.field))

    def _key(self, name: str) -> str:
        return f"{self.app_name}/{name}"

    @serve.multiplexed(max_num_models_per_replica=MAX_ADAPTERS_PER_REPLICA)
    async def _mark_resident(self, name: str) -> str:
        """Tells Serve's router this replica holds the adapter, so its later requests come here."""
        return name

    def stats(self) -> dict:
        stats = self.backend.stats()
        return {**stats, "healthy": stats["healthy"] and not self._lost_rank()}  # what readiness reads

    def _lost_rank(self) -> bool:
        # Rank 0 learns of a lost rank only when a step fails: without requests the replica would
        # pass its health checks for good, and Serve would never place it again on live nodes.
        return self.launcher is not None and self.launcher.lost_rank()

    def placement(self) -> list[dict]:
        """Rank 0 (this replica) and the other ranks: placement group and node of each."""
        return [placement_of_this_process()] + (self.launcher.placements() if self.launcher else [])

    def __del__(self):  # Serve calls this when the replica stops (after draining): release the ranks
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.shutdown()

    def check_health(self) -> None:
        if not self.backend.healthy:
            raise RuntimeError(f"the {self.backend.name} engine backend is not healthy")
        if self._lost_rank():
            raise RuntimeError("an engine rank has ended (its node lost, or its actor killed)")
