"""Preemption notices judged at the controller (controller.replanning.drains): a notice with
room to move asks for a re-plan; one too short for the move asks for a snapshot and leaves the
loss path to the deadline; a node without a rank costs nothing; each says so in its event."""

import time
from types import SimpleNamespace

from elastic_trainer import TrainerConfig
from elastic_trainer.controller.replanning.drains import Drains, enough_notice, leave_by_s, move_seconds
from elastic_trainer.controller.run.run_record import RunRecord

from ..conftest import tiny_config


class _Pool:
    def __init__(self, workers):
        self.workers = workers            # (wid, node, rank)
        self.draining: dict = {}
        self.quarantined: dict = {}
        self.quarantined_workers: set = set()
        self.spawned = 0
        self.joining: dict = {}

    def handles(self):
        return [SimpleNamespace(wid=w, node=n, rank=r) for w, n, r in self.workers]

    def drain(self, node, deadline):
        self.draining[node] = deadline
        gone = [w for w, n, r in self.workers if n == node and r is None]
        self.drop(gone)
        return gone

    def drop(self, wids):
        self.workers = [w for w in self.workers if w[0] not in wids]

    def spawn_on_free_nodes(self):
        self.spawned += 1


    def undrain(self, node):
        self.draining.pop(node, None)


def _drains(notices, estimate_s, workers=((0, "a", 0), (1, "b", 1), (2, "c", None))):
    run = RunRecord(TrainerConfig.from_dict(tiny_config("/nonexistent")), "r")
    pool = _Pool(list(workers))
    asked = []
    d = Drains(run, pool, lambda reason: asked.append(reason), snapshot=lambda: asked.append("snapshot"),
               read=lambda: dict(notices), alive=lambda: {"a", "b", "c"}, check_s=0.0)
    d.estimate = lambda: estimate_s
    return d, run, pool, asked


def test_the_move_estimate_is_a_step_a_fixed_part_and_the_bytes_at_the_measured_rate():
    assert move_seconds(0.5, 100e6, 50e6) == 0.5 + 1.0 + 2.0
    assert move_seconds(None, 0, None) == 2.0   # before the first step: a second for it
    assert enough_notice(None, 100.0) and enough_notice(10.0, 6.0) and not enough_notice(9.0, 6.0)


def test_a_notice_with_room_re_plans_and_one_too_short_snapshots_for_the_loss_path():
    d, run, pool, asked = _drains({"b": time.time() + 20.0}, estimate_s=2.0)
    d.poll()
    [ev] = [e for e in run.events if e["kind"] == "drain"]
    assert asked == ["drain"] and ev["outcome"] == "moved" and ev["ranks"] == [1] and pool.spawned == 1
    assert not d.losing()

    d, run, pool, asked = _drains({"b": time.time() + 3.0}, estimate_s=2.0)
    d.poll()
    [ev] = [e for e in run.events if e["kind"] == "drain"]
    assert asked == ["snapshot"] and ev["outcome"] == "loss" and pool.spawned == 1
    assert d.losing()   # the steps go one at a time until the node goes
    assert "then the loss path at the deadline" in ev["action"] and ev["move_estimate_s"] == 2.0


def test_a_notice_for_a_node_without_a_rank_asks_for_nothing():
    d, run, pool, asked = _drains({"c": time.time() + 1.0}, estimate_s=2.0)
    d.poll()
    [ev] = [e for e in run.events if e["kind"] == "drain"]
    assert asked == [] and ev["outcome"] == "idle" and ev["let_go"] == [2] and pool.draining == {"c": ev["deadline"]}


def test_a_cancelled_drain_lets_the_node_be_used_again_and_stops_the_loss_path():
    notices = {"b": time.time() + 3.0}
    d, run, pool, asked = _drains(notices, estimate_s=2.0)
    d.poll()
    assert d.losing() and pool.draining
    notices.clear()   # the drain is gone while the node lives: cancelled
    d.poll()
    ended = [e for e in run.events if e["kind"] == "drain" and e.get("action") == "ended"]
    assert ended and ended[0]["detail"] == "the drain was cancelled", run.events
    assert not d.losing() and pool.draining == {} and asked == ["snapshot"]


def test_a_node_left_to_the_loss_path_that_outlives_its_deadline_is_moved_off():
    notices = {"b": time.time() + 3.0}
    d, run, pool, asked = _drains(notices, estimate_s=2.0)
    d.poll()
    assert asked == ["snapshot"] and d.losing()
    d.poll()
    assert asked == ["snapshot"]   # before its deadline, nothing more
    notices["b"] = time.time() - 5.0   # the deadline long past, the node still draining and alive
    d.poll()
    assert asked == ["snapshot", "drain"] and not d.losing()
    [ev] = [e for e in run.events if e["kind"] == "drain" and "outlived" in e.get("action", "")]
    assert ev["outcome"] == "moved" and ev["node"] == "b"


def test_without_a_spare_a_drained_node_trains_on_until_near_its_deadline_or_a_spare():
    notices = {"b": time.time() + 60.0}
    d, run, pool, asked = _drains(notices, estimate_s=2.0, workers=[(0, "a", 0), (1, "b", 1)])
    d.poll()
    [ev] = [e for e in run.events if e["kind"] == "drain"]
    assert asked == ["snapshot"] and ev["outcome"] == "moved" and "no spare: train on it" in ev["action"]
    assert not d.losing()   # leases as usual: the node is not left to the loss path
    d.poll()
    assert asked == ["snapshot"]
    notices["b"] = time.time() + leave_by_s(2.0) - 0.5   # the last safe moment is near
    d.poll()
    assert asked == ["snapshot", "drain"]
    assert "before its deadline" in [e for e in run.events if e["kind"] == "drain"][-1]["action"]

    notices = {"b": time.time() + 60.0}
    d, run, pool, asked = _drains(notices, estimate_s=2.0, workers=[(0, "a", 0), (1, "b", 1)])
    d.poll()
    pool.workers.append((3, "d", None))   # a replacement joined: move now, the layout kept
    d.poll()
    assert asked == ["snapshot", "drain"] and "a spare is ready" in run.events[-1]["action"]
