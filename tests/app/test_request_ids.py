"""The app's registry of client-chosen request ids (app/request_ids.py), with no Ray: ids unique
among requests in flight, stops handed to the owning replica, a dead owner's ids dropped."""
import asyncio

import pytest

from app.engine import InvalidRequestError
from app.request_ids import RequestIds


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _refused(call, *args) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        call(*args)
    assert err.value.field == "request_id"
    return err.value


def test_an_id_in_flight_is_claimed_once_app_wide():
    ids = RequestIds()
    ids.claim("a", "ingress-1")
    assert _refused(ids.claim, "a", "ingress-2").status == 409
    ids.release("a", "ingress-1")
    ids.claim("a", "ingress-2")  # free again once its stream ended


def test_a_stop_reaches_the_owner_wherever_it_landed():
    async def main():
        ids = RequestIds()
        ids.claim("a", "ingress-1")
        ids.claim("b", "ingress-2")
        poll = asyncio.ensure_future(ids.take("ingress-1", timeout_s=5))
        await asyncio.sleep(0)
        ids.stop("a")  # sent to any replica: the registry knows the owner
        return await asyncio.wait_for(poll, 1), await ids.take("ingress-2", timeout_s=0.01)

    assert asyncio.run(main()) == (["a"], [])


def test_an_id_not_in_flight_cannot_be_stopped():
    ids = RequestIds()
    assert _refused(ids.stop, "nobody").status == 404
    ids.claim("a", "ingress-1")
    ids.release("a", "ingress-1")
    assert _refused(ids.stop, "a").status == 404


def test_a_release_by_another_owner_is_ignored():
    ids = RequestIds()
    ids.claim("a", "ingress-1")
    ids.release("a", "ingress-2")
    assert ids.ids == {"a": "ingress-1"}


def test_an_owner_that_stops_polling_loses_its_ids():
    clock = Clock()
    ids = RequestIds(lease_s=30, clock=clock)
    ids.claim("a", "dead")
    ids.claim("b", "alive")
    clock.now = 20
    asyncio.run(ids.take("alive", timeout_s=0))
    clock.now = 31
    ids.claim("a", "alive")  # the dead replica's id is free; the live one keeps its own
    assert ids.ids == {"a": "alive", "b": "alive"} and set(ids.owners) == {"alive"}
