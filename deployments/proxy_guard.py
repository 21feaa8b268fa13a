"""The connection limits (app/connections.py) inside Serve's HTTP proxy, which terminates HTTP in
uvicorn and offers no such limits of its own: uvicorn has no timeout for reading headers, and Serve
passes it no connection cap.

Serve calls `install` in each proxy process before its uvicorn server starts, when the proxy's
environment names it (set before `ray start`, or before `ray.init` for a local cluster):

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.proxy_guard:install

`install` swaps uvicorn's HTTP protocol for a guarded subclass (Serve builds uvicorn's config itself,
so the protocol class uvicorn resolves by name is the only way in) and returns the middleware that
bounds body reads.
"""
from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import logging
import resource
from http import HTTPStatus
from typing import ClassVar

import uvicorn.protocols.http.auto
from starlette.middleware import Middleware
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.connections import (BODY_TIMEOUT_ENV, EXPIRE_BATCH, HEADER_TIMEOUT_ENV, MAX_CONNECTIONS_ENV, ConnectionLimits,
                             ConnectionTable)

logger = logging.getLogger("ray.serve")


def install() -> list[Middleware]:
    """Serve's proxy callback: guard this process's uvicorn server with the limits from the environment."""
    limits = ConnectionLimits.from_env()
    fd_limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = limits.connection_cap(fd_limit)
    uvicorn.protocols.http.auto.AutoHTTPProtocol = guarded_protocol(ConnectionTable(limits, cap))
    logger.info("connection limits: headers %.3g s, body %.3g s, %d connections (file limit %d)",
                limits.header_timeout_s, limits.body_timeout_s, cap, fd_limit)
    return [Middleware(BodyTimeoutMiddleware, timeout_s=limits.body_timeout_s)]


def guarded_protocol(table: ConnectionTable) -> type[GuardedHttpToolsProtocol]:
    """A protocol class for one server: its connections share `table`."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"guard": _Sweeper(table)})


def _release_memory() -> None:
    """Give a passed flood's memory back to the system: its connections are reference cycles (protocol,
    transport, parser) that wait for a full collection, and glibc keeps freed pages until trimmed."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc
        pass


def error_response(status: int, message: str, *headers: str) -> bytes:
    """A whole `{"error": ...}` response that closes the connection, written before any request runs."""
    body = _error_body(message)
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _Sweeper:
    """A server's table and the one timer that closes its overdue header reads; the timer runs only
    while connections are open, so an idle server holds no timer."""

    def __init__(self, table: ConnectionTable):
        self.table = table
        self._timer: asyncio.Handle | None = None

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is None:
            self._timer = loop.call_later(self.table.limits.sweep_interval_s, self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        message = f"headers: not complete within {self.table.limits.header_timeout_s:g} s ({HEADER_TIMEOUT_ENV})"
        late = self.table.expired(loop.time())
        for conn in late:
            conn.reject(408, message)
        if len(late) == EXPIRE_BATCH:  # more are overdue: go on after the requests that are waiting
            self._timer = loop.call_soon(self._sweep, loop)
            return
        if self.table.flood_passed():
            _release_memory()
        if len(self.table):
            self.watch(loop)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol reporting each connection's state to the server's table."""

    guard: ClassVar[_Sweeper]

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        admission = self.guard.table.open(self, self.loop.time())
        if admission.evicted is not None:
            admission.evicted.transport.close()
        if not admission.admitted:
            cap = self.guard.table.cap
            self.reject(503, f"connections: all {cap} are busy with requests ({MAX_CONNECTIONS_ENV}); retry later",
                        "retry-after: 1")
            return
        self.guard.watch(self.loop)

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.table.close(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.guard.table.request_started(self, self.loop.time())
        super().data_received(data)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self.guard.table.headers_complete(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle.response_complete:  # else a pipelined request has started
            self.guard.table.response_complete(self, self.loop.time())

    def handle_websocket_upgrade(self) -> None:
        self.guard.table.close(self)  # the connection belongs to uvicorn's WebSocket protocol from here
        super().handle_websocket_upgrade()

    def reject(self, status: int, message: str, *headers: str) -> None:
        """Answer with an error, unless a response is under way, and close."""
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(error_response(status, message, *headers))
        self.transport.close()


class BodyTimeoutMiddleware:
    """Ends a request whose body has not arrived `timeout_s` after its headers with 408. Serve's proxy
    reads bodies as they come (into a queue for the replica), so the time measured is the client's."""

    def __init__(self, app, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = _TimedBody(receive, send, self.timeout_s)
        await self.app(scope, request.receive, request.send)


class _TimedBody:
    """One request's `receive` and `send` with a deadline on the body."""

    def __init__(self, receive, send, timeout_s: float):
        self._receive, self._send, self.timeout_s = receive, send, timeout_s
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + timeout_s
        self._body_done = self._started = self._answered = False

    async def receive(self):
        if self._answered:
            return {"type": "http.disconnect"}
        if self._body_done or self._started:  # an app that answers early needs no more of the body
            return await self._receive()
        try:
            message = await asyncio.wait_for(self._receive(), max(0.0, self._deadline - self._loop.time()))
        except asyncio.TimeoutError:
            if self._started:  # the app began its answer while this read waited
                return await self._receive()
            await self._send_error(408, f"body: not complete within {self.timeout_s:g} s ({BODY_TIMEOUT_ENV})")
            return {"type": "http.disconnect"}  # the app stops; anything it still sends is dropped
        self._body_done = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    async def send(self, message):
        if not self._answered:
            self._started = True
            await self._send(message)

    async def _send_error(self, status: int, message: str) -> None:
        self._answered = True
        body = _error_body(message)
        await self._send({"type": "http.response.start", "status": status,
                          "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                                      (b"connection", b"close")]})
        await self._send({"type": "http.response.body", "body": body})


def _error_body(message: str) -> bytes:
    """The body of the Triton routes' errors (app/security.py's refusals look the same)."""
    return json.dumps({"error": message}).encode()
