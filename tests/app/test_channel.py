"""The data plane (app/channel.py) on loopback: a producer task stands in for the Serve call."""
import asyncio
import socket
from dataclasses import dataclass

import pytest

from app.channel import ChannelError, Inbound, Outbound, ReplyTo


@dataclass
class Delta:
    tokens: list[int]
    finished: bool = False


def merge(a: Delta, b: Delta) -> Delta:
    return Delta(a.tokens + b.tokens, b.finished)


class Call:
    """A unary call as the consumer sees it: awaitable once, cancellable."""

    def __init__(self, coroutine):
        self.task = asyncio.ensure_future(coroutine)

    def __await__(self):
        return self.task.__await__()

    def cancel(self):
        self.task.cancel()


async def deltas(n: int, gap_s: float = 0.0, log: list | None = None, fail_at: int | None = None):
    try:
        for i in range(n):
            if i == fail_at:
                raise ValueError("boom")
            await asyncio.sleep(gap_s)
            yield Delta([i], i == n - 1)
    finally:
        if log is not None:
            log.append("closed")


def _plane(n: int, gap_s: float = 0.0, log: list | None = None):
    """A consumer and a producer on loopback, and the `start` of a call producing `n` deltas (kept in `calls`)."""
    inbound, outbound, calls = Inbound("127.0.0.1", merge), Outbound(merge, max_interval_ms=0), []

    def start(to):
        calls.append(Call(outbound.stream(to, deltas(n, gap_s, log))))
        return calls[-1]

    return inbound, outbound, calls, start


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_many_streams_share_one_connection_and_arrive_whole():
    async def main():
        inbound, outbound = Inbound("127.0.0.1", merge), Outbound(merge, max_interval_ms=20)

        async def one(i):
            got = [d async for d in inbound.receive(lambda to: Call(outbound.stream(to, deltas(50 + i, 0.001))))]
            return got

        results = await asyncio.gather(*(one(i) for i in range(40)))
        return results, outbound

    results, outbound = run(main())
    for i, got in enumerate(results):
        assert [t for d in got for t in d.tokens] == list(range(50 + i))
        assert got[-1].finished and not any(d.finished for d in got[:-1])
        assert len(got) < 50  # merged while paced, not one item per delta
    assert len(outbound.connections) == 1


def test_the_first_item_is_not_held_back_by_pacing():
    async def main():
        inbound, outbound = Inbound("127.0.0.1", merge), Outbound(merge, max_interval_ms=1000)
        outbound.active = 100  # as if many streams were open: the full interval applies
        loop = asyncio.get_running_loop()
        started = loop.time()
        async for d in inbound.receive(lambda to: Call(outbound.stream(to, deltas(3, 0.3)))):
            return loop.time() - started

    assert run(main()) < 0.6


def test_a_producer_error_ends_the_stream_after_what_came_before():
    async def main():
        inbound, outbound = Inbound("127.0.0.1", merge), Outbound(merge, max_interval_ms=0)
        got = []
        with pytest.raises(ValueError, match="boom"):
            async for d in inbound.receive(lambda to: Call(outbound.stream(to, deltas(10, 0.01, fail_at=4)))):
                got.extend(d.tokens)
        return got

    got = run(main())
    # The error travels beside the data (in Serve, as the call's result): items written before it
    # may lose the race, but none is lost from the middle and none comes after.
    assert got == list(range(len(got))) and len(got) <= 4


def test_leaving_early_cancels_the_call_and_closes_the_producer():
    async def main():
        log = []
        inbound, _, calls, start = _plane(1000, 0.005, log)
        async for d in inbound.receive(start):
            break
        await asyncio.sleep(0.1)
        return log, calls[0].task.cancelled(), inbound.inboxes

    log, cancelled, inboxes = run(main())
    assert log == ["closed"] and cancelled and not inboxes


def test_setting_stop_ends_the_stream_as_leaving_would():
    async def main():
        log, stop = [], asyncio.Event()
        inbound, _, calls, start = _plane(1000, 0.005, log)
        got = []
        async for d in inbound.receive(start, stop):
            got.append(d)
            stop.set()  # from another task in the Ingress; the reader waits for its next item meanwhile
        await asyncio.sleep(0.1)
        return got, log, calls[0].task.cancelled(), inbound.inboxes

    got, log, cancelled, inboxes = run(main())
    assert 1 <= len(got) <= 2 and not any(d.finished for d in got)  # at most the item already pending
    assert log == ["closed"] and cancelled and not inboxes


def test_a_dead_consumer_cancels_what_is_produced_for_it():
    """The consumer's socket closes (its process died): the producer's stream is cancelled, so
    the work upstream (the engine's request) stops."""
    async def main():
        log = []
        inbound, outbound, calls, start = _plane(100_000, 0.002, log)
        receiving = inbound.receive(start)
        await anext(receiving)
        inbound._server.close()
        for connection in list(outbound.connections.values()):
            (await connection).writer.transport.abort()  # as the kernel does for a killed process
        await asyncio.sleep(0.3)
        return log, calls[0].task

    log, task = run(main())
    assert log == ["closed"] and task.cancelled()


def test_a_dead_consumer_leaves_no_writer_behind():
    """Once the consumer's end closes, the connection's writer task ends too (it waited for items
    forever, holding the connection, once per replaced consumer replica)."""
    async def main():
        inbound, outbound, calls, start = _plane(100_000, 0.002)
        receiving = inbound.receive(start)
        await anext(receiving)
        connection = await next(iter(outbound.connections.values()))
        inbound._server.close()
        connection.writer.transport.abort()
        await asyncio.sleep(0.3)
        return connection.closed, [task for task in outbound._tasks if not task.done()]

    closed, running = run(main())
    assert closed and running == []


def test_an_item_that_cannot_be_written_fails_its_connection_not_hangs():
    """A frame that does not pickle killed the writer and nothing else: every stream on the
    connection, and each later one, waited forever. Now they fail, and the next connects again."""
    async def main():
        inbound, outbound = Inbound("127.0.0.1", merge), Outbound(merge, max_interval_ms=0)

        async def items(bad: bool):
            yield Delta([1])
            yield Delta([lambda: 0] if bad else [2], True)

        async def collect(bad: bool):
            return [d async for d in inbound.receive(lambda to: Call(outbound.stream(to, items(bad))))]

        with pytest.raises(ChannelError):
            await collect(True)
        return await collect(False)

    assert run(main()) == [Delta([1, 2], True)]


def test_a_call_that_returns_without_its_final_item_fails_the_stream(monkeypatch):
    monkeypatch.setattr("app.channel.GRACE_S", 0.2)

    async def main():
        inbound = Inbound("127.0.0.1", merge)

        async def silent():
            return None

        async for _ in inbound.receive(lambda to: Call(silent())):
            pass

    with pytest.raises(ChannelError, match="before its last output"):
        run(main())


def test_a_connection_without_the_secret_is_refused_before_anything_is_read():
    async def main():
        inbound, outbound = Inbound("127.0.0.1", merge), Outbound(merge, max_interval_ms=0)
        got = []

        def start(to: ReplyTo):
            forged = ReplyTo(to.host, to.port, "0" * len(to.secret), to.key)
            return Call(outbound.stream(forged, deltas(3, 0.05)))

        with pytest.raises(ChannelError):
            async for d in inbound.receive(start):
                got.append(d)
        return got

    assert run(main()) == []


def test_keepalive_is_set_on_data_sockets():
    async def main():
        inbound, outbound = Inbound("127.0.0.1", merge), Outbound(merge, max_interval_ms=0)
        async for _ in inbound.receive(lambda to: Call(outbound.stream(to, deltas(1)))):
            pass
        connection = await next(iter(outbound.connections.values()))
        return connection.writer.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)

    assert run(main()) == 1


def test_a_slow_reader_costs_one_merged_item_per_request():
    """The reader takes nothing while 500 deltas are produced: its request holds one merged item
    (memory per request, not per step), and nothing is lost."""
    async def main():
        inbound, _, calls, start = _plane(500)
        receiving = inbound.receive(start)
        first = await anext(receiving)
        await calls[0].task  # the producer finished while the reader took nothing more
        await asyncio.sleep(0.05)
        (inbox,) = inbound.inboxes.values()
        held = inbox.pending
        rest = [d async for d in receiving]
        return first, held, rest

    first, held, rest = run(main())
    assert isinstance(held, Delta) and held.finished
    assert [t for d in [first, *rest] for t in d.tokens] == list(range(500)) and len(rest) == 1


def test_a_batch_over_the_frame_limit_goes_as_several_frames(monkeypatch):
    """Many requests' large items (logits) at once: each frame stays within MAX_FRAME_BYTES,
    which the consumer enforces, and every stream still arrives whole."""
    import app.channel as channel
    import numpy as np

    monkeypatch.setattr(channel, "MAX_FRAME_BYTES", 3000)
    frames = channel._frames([(k, np.zeros(256, np.float32)) for k in range(8)])  # 1 KiB each
    assert len(frames) > 1 and all(len(f) <= 3000 for f in frames)

    async def big(i):
        yield Delta([i, np.ones(256, np.float32)], True)

    async def main():
        inbound, outbound = Inbound("127.0.0.1", merge), Outbound(merge, max_interval_ms=50)

        async def one(i):
            return [d async for d in inbound.receive(lambda to: Call(outbound.stream(to, big(i))))]
        return await asyncio.gather(*(one(i) for i in range(8)))

    for i, got in enumerate(run(main())):
        assert got[0].tokens[0] == i and got[0].tokens[1].sum() == 256
