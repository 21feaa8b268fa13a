"""The app's registry of client-chosen request ids (app/request_ids.py), as one small Serve replica.

A Serve deployment rather than a named actor: it is created, replaced when it dies, and deleted with
its application, like the stages. It holds no model and reserves no CPU. Its state is lost if it is
replaced: the ids in flight then can no longer be stopped by id (404) until they end, and can be
claimed again meanwhile.
"""
from __future__ import annotations

from ray import serve

from app.request_ids import RequestIds


# Each Ingress replica keeps one poll open here while it streams named requests; the other calls
# are short. A replica being replaced would wait out those polls (up to POLL_S) for nothing: its
# state goes with it. Async methods: the registry's state lives on the replica's event loop alone.
@serve.deployment(name="RequestIds", num_replicas=1, max_ongoing_requests=10_000, graceful_shutdown_timeout_s=1,
                  ray_actor_options={"num_cpus": 0})
class RequestIdsDeployment:
    def __init__(self):
        self.ids = RequestIds()

    async def claim(self, request_id: str, owner: str) -> None:
        self.ids.claim(request_id, owner)

    async def release(self, request_id: str, owner: str) -> None:
        self.ids.release(request_id, owner)

    async def stop(self, request_id: str) -> None:
        self.ids.stop(request_id)

    async def take(self, owner: str) -> list[str]:
        return await self.ids.take(owner)
