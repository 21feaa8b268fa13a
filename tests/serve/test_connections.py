"""Connection limits (app/connections.py, deployments/proxy_guard.py): a slowloris flood against the
live proxy, a slow body, and the cap's refusal on a plain uvicorn server under the same guard."""
import asyncio
import os
import select
import socket
import statistics
import threading
import time

import httpx
import psutil
import pytest
import uvicorn

from app.connections import ConnectionLimits, ConnectionTable
from deployments.proxy_guard import guarded_protocol

FLOOD = 3000  # three times the tests' cap (tests/serve/conftest.py), far below the file limit
GENERATE = {"text_input": "Hello", "max_tokens": 4}


def _median_s(call, times: int = 5) -> float:
    spans = []
    for _ in range(times):
        start = time.perf_counter()
        call().raise_for_status()
        spans.append(time.perf_counter() - start)
    return statistics.median(spans)


def _proxy(url: str) -> psutil.Process:
    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
            return psutil.Process(conn.pid)
    raise AssertionError(f"no process listens on {port}")


def _half_open(port: int, n: int) -> list[socket.socket]:
    """n connections that send the start of a request and never finish its headers."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: flood\r\n")
        socks.append(sock)
    return socks


def _still_open(socks: list[socket.socket], timeout_s: float) -> list[socket.socket]:
    """Waits up to timeout_s for the server to close `socks` (EOF, a reset or an answer), closes
    those on this side too, and returns the others."""
    poller, pending = select.poll(), {sock.fileno(): sock for sock in socks}
    for fd in pending:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for fd, _ in poller.poll(200):
            poller.unregister(fd)
            pending.pop(fd).close()
    return list(pending.values())


def _settled_fds(proxy: psutil.Process, target: int, timeout_s: float = 10) -> int:
    """The proxy's open files once they are back to `target`, or after timeout_s: closing thousands of
    sockets takes the proxy's loop a moment after their clients have seen them close."""
    deadline = time.monotonic() + timeout_s
    while proxy.num_fds() > target and time.monotonic() < deadline:
        time.sleep(0.2)
    return proxy.num_fds()


def test_health_and_generate_answer_through_a_slowloris_flood(server):
    proxy = _proxy(server)
    # A new connection per request, as a load balancer's probe makes: each must get past the flood.
    with httpx.Client(base_url=server, timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        health = lambda: http.get("/v2/health/ready")  # noqa: E731
        generate = lambda: http.post("/v2/models/ensemble/generate", json=GENERATE)  # noqa: E731
        quiet_health, quiet_generate = _median_s(health), _median_s(generate)
        fds, rss = proxy.num_fds(), proxy.memory_info().rss

        socks = _half_open(int(server.rsplit(":", 1)[1]), FLOOD)
        try:
            flood_health, flood_generate = _median_s(health), _median_s(generate)
        finally:
            socks = _still_open(socks, 1.0)  # before any header deadline: the evicted are closed
            evicted = FLOOD - len(socks)
            socks = _still_open(socks, ConnectionLimits().header_timeout_s + 5)
            for sock in socks:
                sock.close()
    fds_after = _settled_fds(proxy, fds + 10)
    print(f"health {quiet_health * 1e3:.1f} -> {flood_health * 1e3:.1f} ms, "
          f"generate {quiet_generate * 1e3:.1f} -> {flood_generate * 1e3:.1f} ms, evicted {evicted}, proxy fds "
          f"{fds} -> {fds_after}, rss {rss >> 20} -> {proxy.memory_info().rss >> 20} MiB")
    assert evicted >= FLOOD - int(os.environ["LLM_SERVE_MAX_CONNECTIONS"])
    assert not socks  # the rest timed out reading their headers
    # 2x, plus a margin for a two-core machine that other jobs share.
    assert flood_health < 2 * quiet_health + 0.1
    assert flood_generate < 2 * quiet_generate + 0.25
    assert fds_after <= fds + 10


def test_a_body_that_stalls_gets_408_naming_the_limit(server):
    port = int(server.rsplit(":", 1)[1])
    timeout_s = float(os.environ["LLM_SERVE_BODY_TIMEOUT_S"])
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s + 10) as sock:
        sock.sendall(b"POST /v2/models/ensemble/generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"text_input\": ")
        start = time.monotonic()
        answer = sock.recv(4096)
        elapsed = time.monotonic() - start
        while part := sock.recv(4096):  # the body may come in a later segment; the server closes after
            answer += part
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"LLM_SERVE_BODY_TIMEOUT_S" in answer
    assert timeout_s - 0.5 < elapsed < timeout_s + 3


@pytest.fixture
def guarded_server():
    """A plain uvicorn server under the guard with a cap of 2, whose app holds each request until
    `release` is set: the proxy's protocol without Ray."""
    release = threading.Event()

    async def app(scope, receive, send):
        if scope["type"] == "websocket":  # refused, as the service has no WebSocket routes
            await send({"type": "websocket.close", "code": 1000})
            return
        while not release.is_set():
            await asyncio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    table = ConnectionTable(ConnectionLimits(header_timeout_s=1.0), cap=2)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, http=guarded_protocol(table), lifespan="off",
                            log_level="warning")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        uv = uvicorn.Server(config)
        thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not uv.started:
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", release, table
        release.set()
        uv.should_exit = True
        thread.join(5)


def test_at_the_cap_busy_connections_refuse_newcomers_and_idle_ones_make_room(guarded_server):
    url, release, table = guarded_server
    busy = [threading.Thread(target=httpx.get, args=(url,)) for _ in range(2)]
    for thread in busy:
        thread.start()
    while len(table) < 2:
        time.sleep(0.01)
    time.sleep(0.3)  # both requests' headers are in: the two connections are busy, none waits
    refused = httpx.get(url)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "LLM_SERVE_MAX_CONNECTIONS" in refused.json()["error"]
    release.set()
    for thread in busy:
        thread.join()
    with httpx.Client() as a, httpx.Client() as b, httpx.Client() as c:  # two idle keep-alive, then a third
        assert a.get(url).text == b.get(url).text == c.get(url).text == "ok"
    assert len(table) <= 2


def test_headers_must_finish_in_time_on_new_and_kept_alive_connections(guarded_server):
    url, release, _ = guarded_server
    release.set()
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert sock.recv(4096).endswith(b"ok")
        sock.sendall(b"GET / HTTP/1.1\r\n")  # the next request on the same connection stalls
        start = time.monotonic()
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408") and b"LLM_SERVE_HEADER_TIMEOUT_S" in answer
    assert 0.9 < time.monotonic() - start < 2.5


def test_a_websocket_upgrade_leaves_the_table(guarded_server):
    url, _, table = guarded_server
    port = int(url.rsplit(":", 1)[1])
    for _ in range(3):  # more than the cap: each must have left the table
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 403")
    assert len(table) == 0
