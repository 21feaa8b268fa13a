"""Many small calls to one stage as few calls: what arrives together goes out together.

At 256 streams a wave of requests reaches an Ingress replica at once, and each request's own
Serve call to the Tokenizer (routing, gRPC, the replica's bookkeeping, all on the Ingress's one
event loop) queued behind the others': identity work on token-id prompts took 60-115 ms p50
(docs/PERFORMANCE.md, "Where the way in goes"). `Coalescer` sends the items submitted while a
loop iteration runs as one call, and while `max_in_flight` calls are out it gathers the next ones
for the call that frees a place. A lone item waits for no other: it goes out at the end of the
iteration that submitted it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class Coalescer(Generic[Item, Result]):
    """`await coalescer(item)` returns `call_many([..., item, ...])`'s result for `item`. A result
    that is an exception is raised to its item's caller alone; a call that fails fails its items."""

    def __init__(self, call_many: Callable[[list[Item]], Awaitable[list[Result | BaseException]]],
                 max_in_flight: int = 4, max_items: int = 256):
        self.call_many = call_many
        self.max_in_flight = max_in_flight
        self.max_items = max_items
        self.pending: list[tuple[Item, asyncio.Future]] = []
        self.in_flight = 0
        self.flush_scheduled = False
        self.sending: set[asyncio.Task] = set()  # the loop holds tasks weakly

    async def __call__(self, item: Item) -> Result:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((item, future))
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        self.flush_scheduled = False
        while self.pending and self.in_flight < self.max_in_flight:
            batch, self.pending = self.pending[:self.max_items], self.pending[self.max_items:]
            batch = [(item, future) for item, future in batch if not future.done()]  # callers that left
            if batch:
                self.in_flight += 1
                task = asyncio.ensure_future(self._send(batch))
                self.sending.add(task)
                task.add_done_callback(self.sending.discard)

    async def _send(self, batch: list[tuple[Item, asyncio.Future]]) -> None:
        try:
            results = await self.call_many([item for item, _ in batch])
        except asyncio.CancelledError:  # the loop is closing: so are its callers
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - handed to every caller of the call
            results = [exc] * len(batch)
        finally:
            self.in_flight -= 1
            self._flush()
        for (_, future), result in zip(batch, results):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
