"""Coalescing a stream by time, for every streaming hop of the DAG.

One item per token caps a chain of Serve streaming hops near 2k items/s on the 2-core machine
(../shared/DESIGN.md); so each hop sends its first item at once and then at most one merged item
per interval. The interval grows with the number of streams a replica carries: short when few
(smooth inter-token latency), up to the configured bound when many (throughput).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")

STREAMS_AT_FULL_INTERVAL = 16


class StreamPacer:
    """Counts a replica's open streams and turns that into the current coalescing interval."""

    def __init__(self, max_interval_ms: float):
        self.max_interval_s = max_interval_ms / 1000.0
        self.active = 0

    def interval(self) -> float:
        return self.max_interval_s * min(1.0, self.active / STREAMS_AT_FULL_INTERVAL)

    async def pace(self, source: AsyncIterator[T], merge: Callable[[T, T], T]) -> AsyncIterator[T]:
        self.active += 1
        try:
            async for item in coalesce(source, self.interval, merge):
                yield item
        finally:
            self.active -= 1


async def coalesce(source: AsyncIterator[T], interval: Callable[[], float],
                   merge: Callable[[T, T], T]) -> AsyncIterator[T]:
    """Yield source's items, merging those that arrive within interval() of the last yield.
    The first item and the last one are never delayed; an error in source is re-raised here."""
    pending: list = []
    state = {"done": False, "error": None}
    wake = asyncio.Event()

    async def pump():
        try:
            async for item in source:
                pending[:] = [merge(pending[0], item)] if pending else [item]
                wake.set()
        except Exception as exc:  # noqa: BLE001 - handed to the consumer below
            state["error"] = exc
        finally:
            state["done"] = True
            wake.set()
            if hasattr(source, "aclose"):  # a consumer that left early stops the producer too
                await source.aclose()

    task = asyncio.create_task(pump())
    last_yield = float("-inf")
    try:
        while True:
            await wake.wait()
            wake.clear()
            delay = last_yield + interval() - time.monotonic()
            if delay > 0 and not state["done"]:
                await asyncio.sleep(delay)
            if pending:
                item = pending.pop()
                last_yield = time.monotonic()
                yield item
            if state["done"] and not pending:
                if state["error"] is not None:
                    raise state["error"]
                return
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
