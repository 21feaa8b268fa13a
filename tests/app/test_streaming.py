"""Time-based coalescing: first item at once, merged items after, errors and early exits pass through."""
import asyncio

import pytest

from app.streaming import StreamPacer, coalesce


async def _ticks(n, gap_s, log=None, fail_at=None):
    try:
        for i in range(n):
            if i == fail_at:
                raise RuntimeError("boom")
            yield [i]
            await asyncio.sleep(gap_s)
    finally:
        if log is not None:
            log.append("closed")


def _merge(a, b):
    return a + b


def test_first_item_at_once_then_merged_by_interval():
    async def main():
        return [x async for x in coalesce(_ticks(20, 0.005), lambda: 0.03, _merge)]

    chunks = asyncio.run(main())
    assert chunks[0] == [0]
    assert sum(chunks, []) == list(range(20))
    assert len(chunks) < 10


def test_zero_interval_passes_items_through():
    async def main():
        return [x async for x in coalesce(_ticks(5, 0.002), lambda: 0.0, _merge)]

    assert asyncio.run(main()) == [[i] for i in range(5)]


def test_errors_reach_the_consumer_after_what_came_before():
    async def main():
        got = []
        with pytest.raises(RuntimeError, match="boom"):
            async for x in coalesce(_ticks(10, 0.001, fail_at=3), lambda: 0.0, _merge):
                got.extend(x)
        return got

    assert asyncio.run(main()) == [0, 1, 2]


def test_leaving_early_closes_the_source():
    log = []

    async def main():
        stream = coalesce(_ticks(1000, 0.001, log), lambda: 0.01, _merge)
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(main())
    assert log == ["closed"]


def test_pacer_interval_grows_with_streams():
    pacer = StreamPacer(max_interval_ms=80)
    assert pacer.interval() == 0.0
    pacer.active = 4
    assert pacer.interval() == pytest.approx(0.02)
    pacer.active = 64
    assert pacer.interval() == pytest.approx(0.08)
