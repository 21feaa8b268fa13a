"""Connection limits of the HTTP front door: how long a client may take to send a request, and how
many connections may be open at once. Plain policy (no Ray, no uvicorn); deployments/proxy_guard.py
applies it to the uvicorn server inside Serve's proxy.

A slow client that never finishes its request (slowloris) costs the server a file descriptor and
nothing else, so the defence is about descriptors: every connection must finish its request headers
in time, and when the cap is reached a newcomer takes the place of the connection that has waited
longest without a request in progress, so real clients (health checks included) always get in.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

HEADER_TIMEOUT_ENV = "LLM_SERVE_HEADER_TIMEOUT_S"
BODY_TIMEOUT_ENV = "LLM_SERVE_BODY_TIMEOUT_S"
MAX_CONNECTIONS_ENV = "LLM_SERVE_MAX_CONNECTIONS"
# Closing a connection costs its server ~0.1 ms; closing overdue ones in batches of this many keeps
# each pause of the server's event loop near 10 ms, so requests keep flowing while a flood expires.
EXPIRE_BATCH = 100
# A flood of at least this many connections leaves memory worth handing back once it has passed.
FLOOD_CONNECTIONS = 1000
_ENV = {"header_timeout_s": HEADER_TIMEOUT_ENV, "body_timeout_s": BODY_TIMEOUT_ENV,
        "max_connections": MAX_CONNECTIONS_ENV}


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits and their defaults (the one place they live); each has an environment variable."""

    # From a connection's opening (or its first byte after a response) to the end of its headers.
    header_timeout_s: float = 10.0
    # From the end of the headers to the end of the body; bodies are small (max_request_bytes, 1 MiB).
    body_timeout_s: float = 30.0
    # Open connections per proxy process, further capped by its file limit (connection_cap).
    max_connections: int = 10_000

    def __post_init__(self):
        for name, env in _ENV.items():
            if not getattr(self, name) > 0:
                raise ValueError(f"{env}: must be a positive number, got {getattr(self, name)!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ConnectionLimits:
        values = {}
        for name, env in _ENV.items():
            if env in environ:
                kind = int if name == "max_connections" else float
                try:
                    values[name] = kind(environ[env])
                except ValueError:
                    raise ValueError(f"{env}: must be a positive number, got {environ[env]!r}") from None
        return cls(**values)

    def connection_cap(self, fd_limit: int) -> int:
        """max_connections, but at most half the process's open-file limit: a burst of accepts lands
        before the cap is checked, and Ray's own sockets need descriptors too. A server out of
        descriptors can accept no one, health checks included."""
        return max(1, min(self.max_connections, fd_limit // 2))

    @property
    def sweep_interval_s(self) -> float:
        """How often expired header reads are looked for: a late connection lives at most this longer."""
        return min(1.0, self.header_timeout_s / 4)


@dataclass(frozen=True)
class Admission:
    """What to do with a new connection: admit it or not, and which connection to close first."""

    admitted: bool
    evicted: Hashable | None = None


class ConnectionTable:
    """The open connections of one server and what each is doing.

    A connection is *reading* from when it opens (or from its first byte after a response) until its
    request headers are complete, then *active* until its response is complete, then *idle* (HTTP
    keep-alive) until its next request starts. Reading and idle connections are kept in the order
    they began to wait, so the longest waiter and the expired readers are found from the front.
    A connection leaves the table when it closes, or as soon as the table hands it out to be closed.
    """

    def __init__(self, limits: ConnectionLimits, cap: int):
        self.limits = limits
        self.cap = cap
        self._reading: OrderedDict[Hashable, float] = OrderedDict()  # connection -> waiting since
        self._idle: OrderedDict[Hashable, float] = OrderedDict()
        self._active: set[Hashable] = set()
        self._peak = 0  # most connections open since memory was last handed back

    def __len__(self) -> int:
        return len(self._reading) + len(self._idle) + len(self._active)

    def open(self, conn: Hashable, now: float) -> Admission:
        """A new connection. At the cap it takes the place of the longest waiter; when every
        connection has a request in progress it is refused (the caller answers 503)."""
        evicted = None
        if len(self) >= self.cap:
            evicted = self._longest_waiter()
            if evicted is None:
                return Admission(admitted=False)
            self.close(evicted)
        self._reading[conn] = now
        self._peak = max(self._peak, len(self))
        return Admission(admitted=True, evicted=evicted)

    def request_started(self, conn: Hashable, now: float) -> None:
        """Bytes arrived; on an idle connection they begin the next request's headers."""
        if conn in self._idle:
            del self._idle[conn]
            self._reading[conn] = now

    def headers_complete(self, conn: Hashable) -> None:
        if self._reading.pop(conn, None) is not None:
            self._active.add(conn)

    def response_complete(self, conn: Hashable, now: float) -> None:
        if conn in self._active:
            self._active.discard(conn)
            self._idle[conn] = now

    def close(self, conn: Hashable) -> None:
        """Forget a connection (closed, or about to be); a second call is harmless."""
        self._reading.pop(conn, None)
        self._idle.pop(conn, None)
        self._active.discard(conn)

    def expired(self, now: float) -> list[Hashable]:
        """Up to EXPIRE_BATCH connections whose headers are overdue, forgotten here; the caller closes
        them, and asks again at once when it got a full batch."""
        late = []
        deadline = now - self.limits.header_timeout_s
        while self._reading and len(late) < EXPIRE_BATCH:
            conn, since = next(iter(self._reading.items()))
            if since > deadline:
                break
            del self._reading[conn]
            late.append(conn)
        return late

    def flood_passed(self) -> bool:
        """True once each time the open connections fall to a tenth of a peak of FLOOD_CONNECTIONS or
        more: the moment to hand the flood's memory back (freed connections stay in the allocator)."""
        if self._peak < FLOOD_CONNECTIONS or len(self) > self._peak // 10:
            return False
        self._peak = len(self)
        return True

    def _longest_waiter(self) -> Hashable | None:
        fronts = [next(iter(waiting.items())) for waiting in (self._reading, self._idle) if waiting]
        return min(fronts, key=lambda front: front[1])[0] if fronts else None
