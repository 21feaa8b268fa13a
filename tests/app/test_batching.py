"""Coalescer: what arrives together goes out as one call, and each caller gets its own result."""
import asyncio

import pytest

from app.batching import CallCancelledError, Coalescer


class Stage:
    """A stage that answers after `gate` opens, recording each call's items."""

    def __init__(self):
        self.calls: list[list] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def call_many(self, items: list) -> list:
        self.calls.append(list(items))
        await self.gate.wait()
        return [ValueError(f"refused {x}") if x < 0 else x * 10 for x in items]


def test_items_of_one_iteration_go_as_one_call_and_a_lone_item_alone():
    async def main():
        stage = Stage()
        coalescer = Coalescer(stage.call_many)
        assert await asyncio.gather(*(coalescer(i) for i in range(5))) == [0, 10, 20, 30, 40]
        assert await coalescer(7) == 70
        return stage.calls

    assert asyncio.run(main()) == [[0, 1, 2, 3, 4], [7]]


def test_one_items_error_is_its_own():
    async def main():
        coalescer = Coalescer(Stage().call_many)
        return await asyncio.gather(coalescer(1), coalescer(-2), coalescer(3), return_exceptions=True)

    first, refused, third = asyncio.run(main())
    assert (first, third) == (10, 30)
    assert isinstance(refused, ValueError) and str(refused) == "refused -2"


@pytest.mark.parametrize("raised, seen", [
    (ConnectionError("replica died"), ConnectionError),
    # As a Serve call cancelled under its caller raises, the sending task itself not cancelled.
    (asyncio.CancelledError(), CallCancelledError),
])
def test_a_failed_call_fails_its_items_and_the_next_call_still_goes(raised, seen):
    async def main():
        failing = True

        async def call_many(items):
            if failing:
                raise raised
            return items

        coalescer = Coalescer(call_many, max_in_flight=1)
        results = await asyncio.gather(coalescer(1), coalescer(2), return_exceptions=True)
        failing = False
        return results, await coalescer(3)

    results, after = asyncio.run(main())
    assert all(isinstance(r, seen) for r in results) and after == 3


async def _first_call_held():
    """A coalescer of one call at a time whose first call (item 1) is out and held by its stage."""
    stage = Stage()
    stage.gate.clear()
    coalescer = Coalescer(stage.call_many, max_in_flight=1)
    first = asyncio.ensure_future(coalescer(1))
    await asyncio.sleep(0.01)
    return stage, coalescer, first


def test_while_calls_are_in_flight_later_items_wait_and_go_together():
    async def main():
        stage, coalescer, first = await _first_call_held()
        later = [asyncio.ensure_future(coalescer(i)) for i in (2, 3)]
        await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        held = [list(c) for c in stage.calls]
        stage.gate.set()
        return held, await first, await asyncio.gather(*later), stage.calls

    held, first, later, calls = asyncio.run(main())
    assert held == [[1]]
    assert (first, later, calls) == (10, [20, 30], [[1], [2, 3]])


def test_a_caller_that_left_is_not_sent_and_does_not_disturb_the_others():
    async def main():
        stage, coalescer, first = await _first_call_held()
        leaving, staying = asyncio.ensure_future(coalescer(2)), asyncio.ensure_future(coalescer(3))
        await asyncio.sleep(0.01)
        leaving.cancel()
        stage.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        return await first, await staying, stage.calls

    assert asyncio.run(main()) == (10, 30, [[1], [3]])


def test_max_items_splits_a_large_wave():
    async def main():
        stage = Stage()
        coalescer = Coalescer(stage.call_many, max_items=2)
        await asyncio.gather(*(coalescer(i) for i in range(5)))
        return stage.calls

    assert asyncio.run(main()) == [[0, 1], [2, 3], [4]]


def test_a_call_runs_in_no_callers_context():
    """Ray Serve finds the calling request in the context: a call made in the first caller's context
    would be cancelled with that request, and every other caller's item with it."""
    import contextvars

    request = contextvars.ContextVar("request", default=None)

    async def main():
        seen = []

        async def call_many(items):
            seen.append(request.get())
            return items

        coalescer = Coalescer(call_many, max_in_flight=1)

        async def caller(name):
            request.set(name)
            return await coalescer(name)

        assert await asyncio.gather(*(caller(n) for n in ("a", "b", "c"))) == ["a", "b", "c"]
        return seen

    assert asyncio.run(main()) == [None]


def test_a_call_with_too_few_results_fails_its_callers_instead_of_leaving_them_waiting():
    async def main():
        async def call_many(items):
            return items[:1]

        coalescer = Coalescer(call_many)
        return await asyncio.wait_for(asyncio.gather(coalescer(1), coalescer(2), return_exceptions=True), 5)

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and "returned 1 results" in str(r) for r in results)


def test_a_send_cancelled_before_it_ran_cancels_its_callers_and_frees_its_place():
    async def main():
        async def call_many(items):
            return items

        coalescer = Coalescer(call_many, max_in_flight=1)
        doomed = asyncio.ensure_future(coalescer(1))
        await asyncio.sleep(0)  # the flush is scheduled
        await asyncio.sleep(0)  # it ran: the send task exists and has not started
        for task in list(coalescer.sending):
            task.cancel()
        result = await asyncio.gather(doomed, return_exceptions=True)
        return result, await asyncio.wait_for(coalescer(2), 5)

    (doomed,), after = asyncio.run(main())
    assert isinstance(doomed, asyncio.CancelledError) and after == 2
