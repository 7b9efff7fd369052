"""A lease granted behind another waits for it on the worker, and runs only if it completed."""

import threading
import time

import pytest

from elastic_trainer.worker.lease_order import LeaseOrder, LeaseRefused

from ..helpers import blocked_in_wait


def _queued(order: LeaseOrder, after: int, got: list) -> threading.Thread:
    def run():
        try:
            order.await_end(after, "the lease of steps 9..16", timeout_s=10)
            got.append(("ran", time.perf_counter()))
        except LeaseRefused as e:
            got.append(("refused", str(e)))
    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_lease_that_arrives_first_waits_for_the_one_it_follows():
    order, got = LeaseOrder("worker 3"), []
    t = _queued(order, after=7, got=got)
    assert blocked_in_wait(t) and got == []   # lease 7 has not ended here: the one behind it waits
    ended = time.perf_counter()
    order.ended(7, completed=True)
    t.join(5)
    assert [g[0] for g in got] == ["ran"] and got[0][1] >= ended


def test_a_lease_behind_one_that_failed_is_refused_and_says_which():
    order, got = LeaseOrder("worker 3"), []
    t = _queued(order, after=7, got=got)
    order.ended(7, completed=False)
    t.join(5)
    assert got == [("refused", "worker 3: the lease of steps 9..16 was granted behind lease 7, which did not "
                               "complete here")]


def test_a_lease_behind_one_that_already_ended_goes_at_once_and_old_ends_are_forgotten():
    order = LeaseOrder("worker 3")
    for grant in range(1, 12):
        order.ended(grant, completed=True)
    order.await_end(11, "lease 12")   # no wait
    with pytest.raises(LeaseRefused, match="did not end here within 0.1 s"):
        order.await_end(1, "lease 2", timeout_s=0.1)   # only the last few are kept
