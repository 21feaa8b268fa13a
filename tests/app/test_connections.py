"""The connection policy on its own: limits from the environment, the cap, eviction, header deadlines."""
import pytest

from app.connections import EXPIRE_BATCH, FLOOD_CONNECTIONS, ConnectionLimits, ConnectionTable


def _table(cap=3, header_timeout_s=10.0) -> ConnectionTable:
    return ConnectionTable(ConnectionLimits(header_timeout_s=header_timeout_s), cap)


def test_limits_have_defaults_and_read_the_environment():
    assert ConnectionLimits.from_env({}) == ConnectionLimits(header_timeout_s=10.0, body_timeout_s=30.0,
                                                             max_connections=10_000)
    limits = ConnectionLimits.from_env({"LLM_SERVE_HEADER_TIMEOUT_S": "2.5", "LLM_SERVE_BODY_TIMEOUT_S": "7",
                                        "LLM_SERVE_MAX_CONNECTIONS": "300"})
    assert limits == ConnectionLimits(header_timeout_s=2.5, body_timeout_s=7.0, max_connections=300)


@pytest.mark.parametrize("env, value", [("LLM_SERVE_HEADER_TIMEOUT_S", "0"), ("LLM_SERVE_BODY_TIMEOUT_S", "soon"),
                                        ("LLM_SERVE_MAX_CONNECTIONS", "-1"), ("LLM_SERVE_MAX_CONNECTIONS", "1.5")])
def test_a_bad_limit_is_refused_naming_its_variable(env, value):
    with pytest.raises(ValueError, match=env):
        ConnectionLimits.from_env({env: value})


def test_the_cap_stays_under_half_the_file_limit():
    limits = ConnectionLimits(max_connections=10_000)
    assert limits.connection_cap(fd_limit=1 << 20) == 10_000
    assert limits.connection_cap(fd_limit=20_000) == 10_000
    assert limits.connection_cap(fd_limit=1024) == 512


def test_below_the_cap_every_connection_is_admitted():
    table = _table(cap=3)
    assert all(table.open(conn, now=0.0).admitted for conn in "abc")
    assert len(table) == 3


def test_at_the_cap_a_newcomer_replaces_the_longest_waiter():
    table = _table(cap=3)
    table.open("a", now=0.0)
    table.open("b", now=1.0)
    table.open("c", now=2.0)
    table.headers_complete("a")  # a has a request in progress: never evicted
    admission = table.open("d", now=3.0)
    assert admission.admitted and admission.evicted == "b"
    assert len(table) == 3


def test_idle_keep_alive_connections_wait_from_their_last_response():
    table = _table(cap=2)
    table.open("a", now=0.0)
    table.open("b", now=1.0)
    table.headers_complete("a")
    table.response_complete("a", now=5.0)  # a waits again, since 5 s: b has waited longer
    assert table.open("c", now=6.0).evicted == "b"
    assert table.open("d", now=7.0).evicted == "a"


def test_when_every_connection_has_a_request_a_newcomer_is_refused():
    table = _table(cap=2)
    for conn in "ab":
        table.open(conn, now=0.0)
        table.headers_complete(conn)
    assert table.open("c", now=1.0).admitted is False
    assert len(table) == 2
    table.close("a")
    assert table.open("c", now=2.0).admitted


def test_headers_must_complete_in_time_from_open_and_from_the_next_request():
    table = _table(header_timeout_s=10.0)
    table.open("slow", now=0.0)
    table.open("fast", now=0.0)
    table.headers_complete("fast")
    table.response_complete("fast", now=1.0)
    assert table.expired(now=9.0) == []
    assert table.expired(now=10.0) == ["slow"]
    table.request_started("fast", now=30.0)  # idle for 29 s is fine (keep-alive has its own timeout)
    assert table.expired(now=39.0) == []
    assert table.expired(now=40.5) == ["fast"]
    assert len(table) == 0


def test_active_connections_never_expire_and_late_bytes_do_not_restart_the_clock():
    table = _table(header_timeout_s=1.0)
    table.open("a", now=0.0)
    table.request_started("a", now=0.9)  # more header bytes: still the same deadline
    table.headers_complete("a")
    table.request_started("a", now=5.0)  # body bytes of the request in progress
    assert table.expired(now=100.0) == []


def test_expired_connections_come_in_batches():
    table = _table(cap=EXPIRE_BATCH * 3, header_timeout_s=1.0)
    for conn in range(EXPIRE_BATCH * 2 + 5):
        table.open(conn, now=0.0)
    batches = [len(table.expired(now=2.0)) for _ in range(4)]
    assert batches == [EXPIRE_BATCH, EXPIRE_BATCH, 5, 0]


def test_closing_twice_or_closing_an_evicted_connection_is_harmless():
    table = _table(cap=1)
    table.open("a", now=0.0)
    assert table.open("b", now=1.0).evicted == "a"
    table.close("a")  # its transport reports the loss later
    table.close("b")
    table.close("b")
    assert len(table) == 0


def test_a_passed_flood_is_reported_once():
    table = _table(cap=FLOOD_CONNECTIONS * 2, header_timeout_s=1.0)
    assert not table.flood_passed()
    for conn in range(FLOOD_CONNECTIONS):
        table.open(conn, now=0.0)
    assert not table.flood_passed()  # still open
    while table.expired(now=5.0):
        pass
    assert table.flood_passed()
    assert not table.flood_passed()
