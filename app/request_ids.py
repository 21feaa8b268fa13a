"""The request ids clients chose, app-wide: which Ingress replica streams each, so that a stop
request (Triton's `stop` input) landing on any Ingress replica reaches the one that can end it.

An Ingress replica (an owner) claims an id before its request starts, which keeps ids unique among
requests in flight, and releases it when its stream ends. It learns of the stops for its ids through
one long poll at a time (`take`). A replica that dies never releases: an owner unseen for `lease_s`
(it polls every POLL_S while it holds ids) is taken for dead and its ids are dropped, so they
neither leak nor stay claimed. Plain Python on one event loop; deployments/request_ids.py serves it.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app.engine.errors import InvalidRequestError

POLL_S = 10.0  # the longest an owner's poll waits for a stop before it polls again
LEASE_S = 30.0  # several polls missed: the owner is gone


@dataclass
class _Owner:
    seen: float
    ids: set[str] = field(default_factory=set)
    stops: set[str] = field(default_factory=set)  # stopped, not yet taken by the owner
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class RequestIds:
    def __init__(self, lease_s: float = LEASE_S, clock: Callable[[], float] = time.monotonic):
        self.lease_s, self.clock = lease_s, clock
        self.owners: dict[str, _Owner] = {}
        self.ids: dict[str, str] = {}  # request id -> owner

    def claim(self, request_id: str, owner: str) -> None:
        """Raises 409 naming request_id when that id is in flight already."""
        self._expire()
        if request_id in self.ids:
            raise InvalidRequestError("request_id", f"'{request_id}' is already in flight; a request id must be "
                                                    "unique among the requests in flight", status=409)
        self.ids[request_id] = owner
        self._seen(owner).ids.add(request_id)

    def release(self, request_id: str, owner: str) -> None:
        if self.ids.get(request_id) != owner:
            return  # dropped with an owner taken for dead, or never claimed here (a registry restarted)
        del self.ids[request_id]
        state = self._seen(owner)
        state.ids.discard(request_id)
        state.stops.discard(request_id)

    def stop(self, request_id: str) -> None:
        """Hand a stop to the id's owner; 404 naming request_id when no request is in flight under it."""
        self._expire()
        owner = self.ids.get(request_id)
        if owner is None:
            raise InvalidRequestError("request_id", f"no request '{request_id}' is in flight (it finished, was "
                                                    "stopped, or never started)", status=404)
        state = self.owners[owner]
        state.stops.add(request_id)
        state.wake.set()

    async def take(self, owner: str, timeout_s: float = POLL_S) -> list[str]:
        """The ids of `owner` stopped since its last take: at once if there are some, else once a stop
        comes or after `timeout_s` (then none)."""
        state = self._seen(owner)
        if not state.stops:
            state.wake.clear()
            try:
                await asyncio.wait_for(state.wake.wait(), timeout_s)
            except TimeoutError:
                pass
        stopped, state.stops = sorted(state.stops), set()
        self._seen(owner)
        return stopped

    def _seen(self, owner: str) -> _Owner:
        state = self.owners.get(owner)
        if state is None:
            state = self.owners[owner] = _Owner(self.clock())
        state.seen = self.clock()
        return state

    def _expire(self) -> None:
        now = self.clock()
        for owner, state in list(self.owners.items()):
            if now - state.seen > self.lease_s:
                del self.owners[owner]
                for request_id in state.ids:
                    self.ids.pop(request_id, None)
