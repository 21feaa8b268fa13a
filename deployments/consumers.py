"""Streams whose consumer died end within seconds, so no stage generates for nobody.

Ray does not cancel a streaming call whose caller died: killed mid-stream, an Ingress left the
engine generating every one of its requests to max_tokens, holding their KV blocks. So a stage's
streaming method is told who consumes it (the calling replica's actor name); a watch pings each
consumer that has live streams every `interval_s`, and cancels the streams of one that is gone,
exactly as a client disconnect would: the cancellation reaches the source's `finally`, which
aborts the request upstream.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TypeVar

import ray
from ray.exceptions import ActorDiedError

logger = logging.getLogger("ray.serve")
T = TypeVar("T")
SERVE_NAMESPACE = "serve"  # where Serve names its replica actors


def own_name() -> str | None:
    """This replica's actor name, for the stages it calls to watch (None outside an actor)."""
    try:
        return ray.get_runtime_context().get_actor_name()
    except Exception:  # noqa: BLE001 - not in an actor (a test driving the class directly)
        return None


class ConsumerWatch:
    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.streams: dict[str, set[asyncio.Task]] = {}  # consumer -> tasks iterating its streams
        self._watcher: asyncio.Task | None = None

    async def guard(self, consumer: str | None, source: AsyncIterator[T]) -> AsyncIterator[T]:
        """`source`'s items, cancelled when `consumer` dies. Must be iterated by one task (a
        StreamPacer's pump is): that task is the one cancelled."""
        if consumer is None:
            async for item in source:
                yield item
            return
        task = asyncio.current_task()
        self.streams.setdefault(consumer, set()).add(task)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch())
        try:
            async for item in source:
                yield item
        finally:
            tasks = self.streams.get(consumer, set())
            tasks.discard(task)
            if not tasks:
                self.streams.pop(consumer, None)

    async def _watch(self) -> None:
        while self.streams:
            await asyncio.sleep(self.interval_s)
            consumers = list(self.streams)
            gone = await asyncio.gather(*(self._gone(c) for c in consumers))
            for consumer, dead in zip(consumers, gone):
                if dead:
                    tasks = self.streams.pop(consumer, set())
                    logger.warning("consumer %s died: cancelling its %d streams", consumer, len(tasks))
                    for task in tasks:
                        task.cancel()

    async def _gone(self, consumer: str) -> bool:
        """Dead for sure only: a consumer too busy to answer in time is alive."""
        try:
            handle = await asyncio.to_thread(ray.get_actor, consumer, namespace=SERVE_NAMESPACE)
            await asyncio.wait_for(handle.__ray_ready__.remote(), timeout=self.interval_s * 5)
        except ValueError:  # no live actor of that name
            return True
        except ActorDiedError:
            return True
        except Exception:  # noqa: BLE001 - a timeout or an unreachable node is not a death
            return False
        return False
