"""Routing engine requests: adapter affinity first, then prefix affinity, then power of two choices.

Each engine replica reuses the KV blocks of prompts it has already seen (chained hashes of full
blocks), so a request whose leading blocks another request already sent to replica R is cheapest
on R. The router remembers, per block-hash chain, the replica it last sent that block to and, when
loads are even, tries the replica holding the longest run of the prompt's blocks first (Ray Serve
LLM's PrefixCacheAffinityRouter does this on text in a shared tree actor; here the engine speaks
token ids and each router keeps its own table, which needs no extra actor and no remote call per
request). Requests for a LoRA adapter are narrowed first to the replicas holding it (Serve's
multiplexing), so adapter affinity keeps working.
"""
from __future__ import annotations

import random
from collections import OrderedDict

from ray.serve.request_router import (FIFOMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter,
                                      RunningReplica)

PROMPT_ARG = 1  # EngineDeployment.generate(request_id, prompt_token_ids, params, adapter)


def block_hashes(token_ids: list[int], block_size: int, salt: str = "") -> list[int]:
    """One hash per full block, each chaining the ones before it (so equal hashes mean equal prefixes)."""
    hashes, previous = [], hash(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, tuple(token_ids[start:start + block_size])))
        hashes.append(previous)
    return hashes


class PrefixAffinityRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, block_size: int = 32, max_imbalance: int = 8, max_tracked_blocks: int = 200_000):
        self.block_size, self.max_imbalance, self.max_tracked_blocks = block_size, max_imbalance, max_tracked_blocks
        self.owners: OrderedDict[int, ReplicaID] = OrderedDict()  # block-chain hash -> replica (LRU)
        self.prefix_routed = 0  # requests sent to the replica holding their prefix (tests, logs)

    def _hashes(self, request: PendingRequest | None) -> list[int]:
        if request is None:
            return []
        prompt = request.kwargs.get("prompt_token_ids") or (
            request.args[PROMPT_ARG] if len(request.args) > PROMPT_ARG else None)
        if not isinstance(prompt, list):
            return []
        return block_hashes(prompt, self.block_size, request.metadata.multiplexed_model_id or "")

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None and pending_request.metadata.multiplexed_model_id:
            allowed = self.apply_multiplex_routing(pending_request=pending_request)
            candidates = [r for r in candidate_replicas if r.replica_id in allowed]
        else:
            candidates = list(candidate_replicas)
        if not candidates:
            return []
        two = random.sample(candidates, min(2, len(candidates)))  # power of two choices
        owner = self._prefix_owner(self._hashes(pending_request), candidates)
        if owner is None or not self._balanced(owner, candidates):
            return [two]
        self.prefix_routed += 1
        return [[owner], [r for r in two if r is not owner]]

    def _prefix_owner(self, hashes: list[int], candidates: list[RunningReplica]) -> RunningReplica | None:
        by_id = {r.replica_id: r for r in candidates}
        for h in reversed(hashes):  # the longest cached prefix wins
            owner = by_id.get(self.owners.get(h))
            if owner is not None:
                return owner
        return None

    def _balanced(self, owner: RunningReplica, candidates: list[RunningReplica]) -> bool:
        lengths = {r.replica_id: self._replica_queue_len_cache.get(r.replica_id) for r in candidates}
        known = [n for n in lengths.values() if n is not None]
        mine = lengths[owner.replica_id]
        return mine is None or not known or mine - min(known) <= self.max_imbalance

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        for h in self._hashes(pending_request):
            self.owners[h] = replica_id
            self.owners.move_to_end(h)
        while len(self.owners) > self.max_tracked_blocks:
            self.owners.popitem(last=False)
