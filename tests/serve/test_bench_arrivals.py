"""tools/bench/arrivals.py: what a serve run's per-request stamps say about the engine's steps."""
import pytest

from tools.bench.arrivals import analyse, step_timeline


def _request(arrival: float, scheduled: float, **changed) -> dict:
    stamps = {"sent": arrival - 0.01, "arrival": arrival, "first_scheduled": scheduled,
              "first_token": scheduled + 0.1, "last_token": scheduled + 0.5, "first_seen": scheduled + 0.11,
              "done": scheduled + 0.52}
    return {**stamps, **changed}


def test_a_wait_splits_into_the_step_in_progress_and_the_steps_that_passed_it_by():
    """Requests a step scheduled share its stamp. One that arrived before a step which took only
    others was passed by it: its wait splits into the time until that step began and the rest."""
    # Steps at 1.0 (takes A, B) and 2.0 (takes C, D): C came at 0.5 and waited behind the first.
    stamps = [_request(0.8, 1.0), _request(0.9, 1.0), _request(0.5, 2.0), _request(1.5, 2.0)]
    report = analyse(stamps, bin_ms=1000)
    assert report["requests"] == 4 and report["steps that took new requests"] == 2
    assert report["steps that took others while it waited"] == {0: 3, 1: 1}
    assert report["new requests a step took"]["p50"] == 2
    assert report["  until the next step that took requests"]["mean"] == pytest.approx((200 + 100 + 500 + 500) / 4)
    assert report["  passed by after that"]["mean"] == pytest.approx(1000 / 4)
    assert report["way in ms (sent -> Engine)"]["p50"] == pytest.approx(10)
    assert report["way out ms (last token -> client done)"]["p50"] == pytest.approx(20)
    assert report["arrivals a 1000 ms bin"]["busiest"] == 3  # 0.5, 0.8 and 0.9 in the first second
    assert step_timeline(stamps) == [{"at ms": 500.0, "took": 2, "left waiting": 1, "arrived since the last": 0},
                                     {"at ms": 1500.0, "took": 2, "left waiting": 0, "arrived since the last": 1}]


def test_requests_without_every_engine_stamp_are_left_out():
    """A request with no stamps (another route), one the engine never scheduled or finished (a
    0 stamp), or one whose stamps are out of order counts in nothing; with none left, nothing is
    reported rather than a failure."""
    kept = _request(0.8, 1.0)
    stamps = [None, kept, _request(0.5, 2.0, last_token=0), _request(0.5, 0), _request(3.0, 2.0)]
    assert analyse(stamps)["requests"] == 1
    assert analyse(stamps)["way out ms (last token -> client done)"]["p50"] == pytest.approx(20)
    assert [step["took"] for step in step_timeline(stamps)] == [1]
    assert analyse([None, None]) == {"requests": 0} and step_timeline([None]) == []
