"""A fenced worker that answers again is let back in only once its reset has ended: a reset still
running when the grow check re-plans onto it would tear down the groups its set-up just joined
(controller/failures/fences.py)."""

from types import SimpleNamespace

import pytest

from elastic_trainer.controller.failures import fences as fences_mod
from elastic_trainer.controller.failures.fences import Fences


class Ref:
    def __init__(self, name):
        self.name, self.ready, self.value = name, False, {}


class Actor:
    """Each question's answer is the test's to give: its ref stays unready until then."""

    def __init__(self):
        self.asked: list[Ref] = []

    def __getattr__(self, method):
        def remote(*args):
            ref = Ref(method)
            self.asked.append(ref)
            return ref
        return SimpleNamespace(remote=remote)


class Pool:
    def __init__(self, handle):
        self.workers, self.avoided = {handle.wid: handle}, set()

    def take(self, wids):
        return [self.workers.pop(w) for w in wids if w in self.workers]

    def readmit(self, handle):
        handle.rank = None
        self.workers[handle.wid] = handle


@pytest.fixture
def fake_ray(monkeypatch):
    monkeypatch.setattr(fences_mod, "ray", SimpleNamespace(
        wait=lambda refs, timeout=None: ([r for r in refs if r.ready], []), get=lambda ref: ref.value,
        exceptions=SimpleNamespace(RayError=RuntimeError)))


def test_a_fenced_worker_is_back_in_the_pool_only_after_its_reset_ended(fake_ray):
    actor = Actor()
    handle = SimpleNamespace(wid=7, actor=actor, node="n1", rank=3)
    pool = Pool(handle)
    fences = Fences(pool, timeout_s=60.0, run_name="t")
    assert fences.fence([7], step=5, failure=1) == [7] and 7 not in pool.workers
    ping = actor.asked[-1]
    ping.ready = True                          # it wakes and answers the ping
    assert fences.poll() == [] and actor.asked[-1].name == "group_state"
    actor.asked[-1].ready = True               # its paused step has ended: not busy
    assert fences.poll() == []
    reset = actor.asked[-1]
    assert reset.name == "reset"
    # The reset was sent, not done: a grow check now must not see it as a spare.
    assert 7 not in pool.workers
    assert fences.poll() == [] and 7 not in pool.workers
    reset.ready = True
    events = fences.poll()
    assert [e["outcome"] for e in events] == ["readmitted"] and pool.workers[7].rank is None
    assert not fences.fenced
