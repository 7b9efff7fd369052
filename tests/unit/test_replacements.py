"""Asking the autoscaler for what the run lacks (controller.replanning.replacements): a request
for the whole run while it is short, none while it is whole, withdrawn once whole again and at
the end; workers on draining nodes do not count; a failed request never ends the run."""

from types import SimpleNamespace

from elastic_trainer import TrainerConfig
from elastic_trainer.controller.replanning.replacements import Replacements, worker_bundle
from elastic_trainer.controller.run.run_record import RunRecord
from elastic_trainer.controller.run.workers import WorkerPool

from ..conftest import tiny_config


class _Pool:
    def __init__(self, nodes):
        self.nodes, self.draining, self.joining = list(nodes), {}, {}
        self.quarantined, self.quarantined_workers = {}, set()

    def handles(self):
        return [SimpleNamespace(node=n, wid=i) for i, n in enumerate(self.nodes)]

    staying = WorkerPool.staying   # the pool's own count, over these handles
    leaving = WorkerPool.leaving


def _replacements(nodes, request):
    cfg = TrainerConfig.from_dict(tiny_config("/nonexistent", parallel={"dp": 2, "pp": 2},
                                              scaling={"resources_per_worker": {"CPU": 2.0, "GPU": 0}}))
    run = RunRecord(cfg, "r")
    return Replacements(cfg, run, _Pool(nodes), request=request), run


def test_a_short_run_asks_for_all_its_workers_once_and_withdraws_when_whole():
    asked = []
    r, run = _replacements(["a", "b", "c"], asked.append)
    assert worker_bundle(r.cfg) == {"CPU": 2.0}
    r.update()
    r.update()                                   # still short: asked once
    assert asked == [[{"CPU": 2.0}] * 4] and r.asked == 4
    r.pool.joining = {9: ()}                     # a worker starting on a launched node counts
    r.update()
    assert asked[-1] == [] and r.asked == 0
    events = [(e["action"], e["short"]) for e in run.events if e["kind"] == "replacements"]
    assert events == [("requested", 1), ("withdrawn", 0)]


def test_workers_on_draining_nodes_are_leaving_and_the_start_asks_by_the_room_there_is():
    asked = []
    r, _ = _replacements(["a", "b", "c", "d"], asked.append)
    r.update()
    assert asked == []                           # whole: nothing asked
    r.pool.draining = {"d": None}
    r.update()
    assert asked == [[{"CPU": 2.0}] * 4]
    r.withdraw()
    r.withdraw()                                 # the end: withdrawn once
    assert asked[1:] == [[]]
    r2, _ = _replacements([], asked.append)
    r2.update(room=1)
    assert asked[-1] == [{"CPU": 2.0}] * 4


def test_a_request_that_fails_is_said_once_and_the_run_goes_on(caplog):
    def refuse(bundles):
        raise RuntimeError("no GCS")

    r, run = _replacements(["a"], refuse)
    r.update()
    r.update()
    assert r.asked == 0 and not [e for e in run.events if e["kind"] == "replacements"]
    assert sum("could not ask the autoscaler" in m for m in caplog.messages) == 1
