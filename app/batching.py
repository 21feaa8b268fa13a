"""Many small calls to one stage as few calls: what arrives together goes out together.

At 256 streams a wave of requests reaches an Ingress replica at once, and each request's own
Serve call to the Tokenizer (routing, gRPC, the replica's bookkeeping, all on the Ingress's one
event loop) queued behind the others': identity work on token-id prompts took 85 ms p50
(docs/PERFORMANCE.md, "Where the way in goes"). `Coalescer` gathers the items submitted before the
event loop runs its next callbacks and sends them as one call (at most `max_items`); while
`max_in_flight` calls are out, it gathers the next ones for the call that frees a place. A lone item
waits for no other.

A call belongs to no request. asyncio copies the caller's context into the callbacks and tasks it
makes, and Ray Serve reads the calling request from that context: it would cancel the call, with
every other request's item in it, when that one request's client goes away. So each call runs in a
context of its own.
"""
from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class CallCancelledError(RuntimeError):
    """The call that carried an item was cancelled under it (not by its caller)."""


class Coalescer(Generic[Item, Result]):
    """`await coalescer(item)` returns `call_many([..., item, ...])`'s result for `item`. A result
    that is an exception is raised to its item's caller alone; a call that fails (raises, is
    cancelled under its callers, or returns a list of another length) fails every item it carried."""

    def __init__(self, call_many: Callable[[list[Item]], Awaitable[list[Result | BaseException]]],
                 max_in_flight: int = 4, max_items: int = 256):
        self.call_many = call_many
        self.max_in_flight = max_in_flight
        self.max_items = max_items
        self.pending: list[tuple[Item, asyncio.Future]] = []
        self.flush_scheduled = False
        self.sending: dict[asyncio.Task, list[asyncio.Future]] = {}  # calls out, and whose items they carry

    async def __call__(self, item: Item) -> Result:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.append((item, future))
        if not self.flush_scheduled:
            self.flush_scheduled = True
            loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        self.flush_scheduled = False
        while self.pending and len(self.sending) < self.max_in_flight:
            batch, self.pending = self.pending[:self.max_items], self.pending[self.max_items:]
            batch = [(item, future) for item, future in batch if not future.done()]  # callers that left
            if batch:
                task = asyncio.get_running_loop().create_task(self._send(batch), context=contextvars.Context())
                self.sending[task] = [future for _, future in batch]
                task.add_done_callback(self._sent)

    async def _send(self, batch: list[tuple[Item, asyncio.Future]]) -> None:
        try:
            results = await self.call_many([item for item, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"a call of {len(batch)} items returned {len(results)} results")
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this task itself: the loop is closing (_sent cancels the callers)
                raise
            results = [CallCancelledError("the call carrying this request was cancelled")] * len(batch)
        except Exception as exc:  # noqa: BLE001 - handed to every caller of the call
            results = [exc] * len(batch)
        for (_, future), result in zip(batch, results):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    def _sent(self, task: asyncio.Task) -> None:
        # Whatever the call did not answer (a task cancelled before it ran, an exception that is not
        # an Exception) is cancelled, never left waiting; its place goes to the next items.
        for future in self.sending.pop(task):
            if not future.done():
                future.cancel()
        self._flush()
