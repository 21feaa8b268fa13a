"""The data plane between two stages: one connection per (producer replica, consumer replica).

A Ray streaming call per request per hop serializes and ships every item on its own; at hundreds
of streams those per-item costs, not the GPU, bound what reaches clients (docs/PERFORMANCE.md).
So the stages split the two planes:

- Control stays with Serve. The consumer calls the producer's method as a plain (unary) call, which
  Serve routes (adapter and prefix affinity), counts as ongoing until the request ends (autoscaling,
  max_ongoing_requests, draining), cancels when the consumer cancels it, and fails with the
  producer replica's death.
- Data goes over one TCP connection from each producer replica to each consumer replica. The
  producer merges each request's deltas while the connection is busy or inside the pacing interval,
  and writes one frame holding every pending request's delta. The consumer reads frames into one
  slot per request (merged again if that request's reader lags), so a slow reader costs memory per
  request, never per step. Items are a stage's deltas (RequestOutput, TextChunk): a `merge` folds
  two of one request into one, and the item whose `finished` is set ends the request's stream.

The consumer opens a listening socket and names it, with a fresh secret and a per-request key, in
each call (`ReplyTo`); the producer connects once per consumer and authenticates with the secret
before anything on the connection is unpickled. A consumer that dies closes its connections: the
producer cancels every request it was producing for it, exactly as a client disconnect would.
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import pickle
import secrets
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger("ray.serve")
HEADER = struct.Struct("!I")  # the length of the frame that follows
MAX_FRAME_BYTES = 1 << 28
AUTH_TIMEOUT_S = 5.0
# A call that returned (or a connection that dropped) before its final item arrived: how long the
# items already written may take to arrive, or the call's own error to come, before the stream fails.
GRACE_S = 5.0
STREAMS_AT_FULL_INTERVAL = 16  # the pacing interval reaches its bound at this many open streams


class ChannelError(ConnectionError):
    """A stream's data connection failed, or a producer returned without sending its final item."""


@dataclass(frozen=True)
class ReplyTo:
    """Where a producer sends one request's items: the consumer's socket, its secret, the request's key."""
    host: str
    port: int
    secret: str
    key: int

    @property
    def consumer(self) -> tuple[str, int, str]:
        return self.host, self.port, self.secret


class Call(Protocol):
    """The unary call that produces a stream's items (a Serve DeploymentResponse)."""

    def __await__(self): ...

    def cancel(self) -> None: ...


def _keep_alive(sock: socket.socket | None) -> None:
    """A peer whose host vanished without closing (a lost node) is noticed in ~10 s, not hours."""
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


# -- the consumer's end ----------------------------------------------------------------------------
class _Inbox:
    """One request's items at the consumer: a single slot, merged while its reader lags."""

    def __init__(self, merge: Callable[[Any, Any], Any], stop: asyncio.Event | None):
        self.merge = merge
        self.stop = stop
        self.pending = None
        self.connection: object | None = None  # the connection its items come on
        self.changed = asyncio.Event()
        self.call: asyncio.Future | None = None
        self.lost = False

    def put(self, item) -> None:
        self.pending = item if self.pending is None else self.merge(self.pending, item)
        self.changed.set()

    async def get(self):
        """The next item, or None once `stop` is set."""
        deadline = None
        while True:
            self.changed.clear()
            if self.pending is not None:
                item, self.pending = self.pending, None
                return item
            if self.stop is not None and self.stop.is_set():
                return None
            call = self.call
            if call.done() and call.cancelled():
                raise ChannelError("the producer's call was cancelled")
            if call.done() and call.exception() is not None:
                raise call.exception()
            if not (call.done() or self.lost):
                await self.changed.wait()
                continue
            # The call returned, or the connection dropped: frames written before may still be on
            # their way, and a dead producer's call is about to fail with the reason.
            deadline = deadline or time.monotonic() + GRACE_S
            try:
                await asyncio.wait_for(self.changed.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise ChannelError("the stream's data connection closed before its last output arrived" if self.lost
                                   else "the producer returned before its last output arrived") from None


def _retrieve(call: asyncio.Future) -> None:
    """Fetch a finished call's outcome, which nobody awaits any more (asyncio warns otherwise)."""
    if not call.cancelled():
        call.exception()


class Inbound:
    """A consumer replica's listening socket, and the open streams waiting for items on it."""

    def __init__(self, host: str, merge: Callable[[Any, Any], Any]):
        self.host, self.merge = host, merge
        self.secret = secrets.token_hex(16)
        self.inboxes: dict[int, _Inbox] = {}
        self.keys = itertools.count()
        self.port: int | None = None
        self._server: asyncio.Server | None = None
        self._starting: asyncio.Lock | None = None

    async def _start(self) -> None:
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if self._server is None:
                self._server = await asyncio.start_server(self._serve, self.host, 0)
                self.port = self._server.sockets[0].getsockname()[1]

    async def receive(self, start: Callable[[ReplyTo], Call], stop: asyncio.Event | None = None) -> AsyncIterator:
        """The items of the call `start(reply_to)` until its final one. The call's error ends the
        stream after the items that came before it; leaving early cancels the call, and so does
        setting `stop` (a stop request by id), which ends the stream as if its reader had left."""
        if self._server is None:
            await self._start()
        key = next(self.keys)
        inbox = self.inboxes[key] = _Inbox(self.merge, stop)
        finished, call, waker = False, None, None
        if stop is not None:
            waker = asyncio.ensure_future(stop.wait())
            waker.add_done_callback(lambda _: inbox.changed.set())
        try:
            call = start(ReplyTo(self.host, self.port, self.secret, key))
            inbox.call = asyncio.ensure_future(call)
            inbox.call.add_done_callback(lambda _: inbox.changed.set())
            while True:
                item = await inbox.get()
                if item is None:
                    return
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            del self.inboxes[key]
            if waker is not None:
                waker.cancel()
            if inbox.call is not None:
                # Finished: the call returns by itself once its last frame is out (cancelling would
                # cost a remote call and a logged error per request); left early: cancel it.
                inbox.call.add_done_callback(_retrieve)
                if not finished and not inbox.call.done():
                    call.cancel()
                    inbox.call.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = object()
        _keep_alive(writer.get_extra_info("socket"))
        try:
            presented = await asyncio.wait_for(reader.readexactly(len(self.secret)), AUTH_TIMEOUT_S)
            if not hmac.compare_digest(presented, self.secret.encode()):
                logger.warning("refused a data connection from %s: wrong secret", writer.get_extra_info("peername"))
                return
            while True:
                (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
                if size > MAX_FRAME_BYTES:
                    raise ChannelError(f"a frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
                for key, item in pickle.loads(await reader.readexactly(size)):
                    inbox = self.inboxes.get(key)
                    if inbox is not None:  # else the stream was left already
                        inbox.connection = connection
                        inbox.put(item)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, OSError):
            pass  # the producer went away: its calls fail with the reason
        except asyncio.CancelledError:
            pass  # the loop is closing; asyncio would log a cancelled connection handler as an error
        finally:
            writer.close()
            for inbox in self.inboxes.values():
                if inbox.connection is connection:
                    inbox.lost = True
                    inbox.changed.set()


# -- the producer's end ----------------------------------------------------------------------------
class _Connection:
    """The producer's connection to one consumer: requests' pending items, written a frame at a time."""

    def __init__(self, writer: asyncio.StreamWriter, merge: Callable[[Any, Any], Any], interval: Callable[[], float]):
        self.writer, self.merge, self.interval = writer, merge, interval
        self.pending: dict[int, Any] = {}
        self.flushed: dict[int, asyncio.Future] = {}  # key -> resolved once its final item is written
        self.streams: set[asyncio.Task] = set()  # the tasks producing for this consumer
        self.wake, self.urgent = asyncio.Event(), asyncio.Event()
        self.closed = False
        self.on_close: Callable[[], None] = lambda: None
        self.last_write = float("-inf")

    def put(self, key: int, item, urgent: bool) -> None:
        if self.closed:
            raise ChannelError("the consumer's data connection is closed")
        self.pending[key] = self.merge(self.pending[key], item) if key in self.pending else item
        self.wake.set()
        if urgent:
            self.urgent.set()

    async def flush(self, key: int) -> None:
        """Returns once the key's pending item is written (at once when none is pending)."""
        if key in self.pending:
            future = self.flushed.setdefault(key, asyncio.get_running_loop().create_future())
            await future

    async def write_frames(self) -> None:
        try:
            while True:
                await self.wake.wait()
                if self.closed:  # close() wakes this writer to end it
                    return
                delay = self.last_write + self.interval() - time.monotonic()
                if delay > 0 and not self.urgent.is_set():
                    try:  # more items merge meanwhile; a first or last item cuts the wait short
                        await asyncio.wait_for(self.urgent.wait(), delay)
                    except TimeoutError:
                        pass
                    if self.closed:  # closed while it waited
                        return
                self.wake.clear()
                self.urgent.clear()
                batch, self.pending = self.pending, {}
                done = [self.flushed.pop(key) for key in batch if key in self.flushed]
                for data in _frames(list(batch.items())):
                    self.writer.write(HEADER.pack(len(data)) + data)
                await self.writer.drain()
                self.last_write = time.monotonic()
                for future in done:
                    if not future.done():
                        future.set_result(None)
        except (ConnectionError, OSError) as exc:
            self.close(exc)
        except Exception as exc:  # noqa: BLE001 - e.g. an item that does not pickle
            # Every stream on this connection waits on this writer: end them with the reason rather
            # than leave them hanging; the next stream connects again.
            logger.exception("the writer of a data connection failed; closing it")
            self.close(exc)

    async def watch(self, reader: asyncio.StreamReader) -> None:
        """The consumer never writes: end of file here means it closed or died."""
        try:
            await reader.read()
        except (ConnectionError, OSError):
            pass
        self.close(ChannelError("the consumer closed its data connection"))

    def close(self, reason: BaseException) -> None:
        if self.closed:
            return
        self.closed = True
        self.on_close()
        self.writer.close()
        self.wake.set()  # the writer task ends
        for future in self.flushed.values():
            if not future.done():
                future.set_exception(ChannelError(str(reason)))
        if self.streams:
            logger.warning("a consumer's data connection closed (%s): cancelling its %d streams", reason,
                           len(self.streams))
        for task in self.streams:
            task.cancel()


def _frames(items: list) -> list[bytes]:
    """The (key, item) pairs pickled into one frame, or into several where one would pass
    MAX_FRAME_BYTES (many requests' logits at once: each request's are bounded far below it)."""
    data = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) <= MAX_FRAME_BYTES or len(items) == 1:
        return [data]
    return _frames(items[:len(items) // 2]) + _frames(items[len(items) // 2:])


class Outbound:
    """A producer replica's connections to its consumers, and the pacing of what it writes on them."""

    def __init__(self, merge: Callable[[Any, Any], Any], max_interval_ms: float):
        self.merge = merge
        self.max_interval_s = max_interval_ms / 1000.0
        self.active = 0  # streams open in this replica
        self.connections: dict[tuple[str, int, str], Awaitable[_Connection]] = {}
        self._tasks: set[asyncio.Task] = set()

    def interval(self) -> float:
        """Frames go out at once while few streams are open (smooth inter-token latency), and at
        most one per `max_interval` when many are (a frame then carries many deltas)."""
        return self.max_interval_s * min(1.0, self.active / STREAMS_AT_FULL_INTERVAL)

    async def _connect(self, consumer: tuple[str, int, str]) -> _Connection:
        host, port, secret = consumer
        reader, writer = await asyncio.open_connection(host, port)
        _keep_alive(writer.get_extra_info("socket"))
        writer.write(secret.encode())
        connection = _Connection(writer, self.merge, self.interval)
        connection.on_close = lambda: self.connections.pop(consumer, None)  # a dead consumer's entry goes
        for job in (connection.write_frames(), connection.watch(reader)):
            task = asyncio.create_task(job)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return connection

    async def connection(self, consumer: tuple[str, int, str]) -> _Connection:
        """The open connection to `consumer`, made on first use (concurrent callers share it)."""
        pending = self.connections.get(consumer)
        if pending is None:
            pending = self.connections[consumer] = asyncio.ensure_future(self._connect(consumer))
        try:
            connection = await asyncio.shield(pending)  # a cancelled caller leaves the others' connect be
        except Exception:
            if self.connections.get(consumer) is pending:
                del self.connections[consumer]
            raise
        if connection.closed:  # the consumer went away; a replica that took its address gets a new one
            if self.connections.get(consumer) is pending:
                del self.connections[consumer]
            return await self.connection(consumer)
        return connection

    async def stream(self, reply_to: ReplyTo, items: AsyncIterator) -> None:
        """Send `items` to the consumer until the final one, and return once it is written. The
        consumer's connection closing cancels this (and so, through `items`, the work upstream)."""
        connection = await self.connection(reply_to.consumer)
        task = asyncio.current_task()
        connection.streams.add(task)
        self.active += 1
        try:
            try:
                async with aclosing(items):
                    first = True
                    async for item in items:
                        connection.put(reply_to.key, item, urgent=first or item.finished)
                        first = False
                        if item.finished:
                            break
            except Exception:
                connection.urgent.set()  # what came before the error goes out before the error does
                await connection.flush(reply_to.key)
                raise
            await connection.flush(reply_to.key)
        finally:
            self.active -= 1
            connection.streams.discard(task)
