"""How a rank leaves its groups, by backend: gloo destroys, NCCL aborts (never flushes).

The routines run for real on a one-rank gloo group; an NCCL group is stood in
for by reporting the backend as ``nccl`` (torch's abort works on gloo groups
too), which is how the choice is made in the code.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from elastic_trainer.controller.failures.survivor_collectives import ShrunkWorld, end_collectives, exclusion, shrunk_ranks
from elastic_trainer.parallel.topology import Topology
from elastic_trainer.planning.plan import Plan
from elastic_trainer.worker import group_failure
from elastic_trainer.worker.device import device_index, worker_device
from elastic_trainer.worker.group_keeper import GroupKeeper
from elastic_trainer.worker.process_group import destroy_groups
from elastic_trainer.worker.step_guard import CollectiveTimeout, StepGuard


@pytest.fixture
def gloo_world(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    dist.new_group([0])
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def calls(monkeypatch):
    """Which torch routine each leave reaches (the real routine still runs)."""
    seen: list[str] = []
    destroy, abort = dist.destroy_process_group, c10d._abort_process_group

    def spy_destroy(*a, **k):
        seen.append("destroy_process_group")
        return destroy(*a, **k)

    def spy_abort(*a, **k):
        seen.append("_abort_process_group")
        return abort(*a, **k)

    monkeypatch.setattr(dist, "destroy_process_group", spy_destroy)
    monkeypatch.setattr(c10d, "_abort_process_group", spy_abort)
    return seen


def test_each_backend_gets_its_leave_routine():
    assert group_failure.leave_routine("gloo") == "destroy"
    assert group_failure.leave_routine("nccl") == "abort"
    assert group_failure.leave_routine("cpu:gloo,cuda:nccl") == "abort"  # holds NCCL communicators
    assert not group_failure.abort_needed("gloo") and group_failure.abort_needed("NCCL")
    with pytest.raises(ValueError, match="'mpi'.*known: gloo, nccl"):
        group_failure.leave_routine("mpi")


def test_gloo_leaves_by_destroying_as_before(gloo_world, calls):
    destroy_groups()
    assert calls == ["destroy_process_group"]
    assert not dist.is_initialized() and dist.get_pg_count() == 0


def test_nccl_leaves_by_aborting_never_by_destroying(gloo_world, calls, monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    destroy_groups()
    assert calls == ["_abort_process_group"]
    # Everything is forgotten, the name counter too: the next plan's groups get the peers' names.
    assert not dist.is_initialized() and c10d._world.group_count == 0


def test_the_controllers_abort_reaches_nccl_groups_only(gloo_world, calls, monkeypatch):
    keeper = GroupKeeper("test")
    keeper.backend = "gloo"
    # gloo's collectives fail on their own where a peer died; where one went silent the
    # controller asks, and the groups' sockets are cut (none here: a file store, one rank).
    assert keeper.fail([1], shrink_id=1) == {"shrunk": False, "aborted": False, "sockets_cut": 0}
    assert calls == [] and dist.is_initialized()
    keeper.backend = "nccl"
    assert not group_failure.can_shrink()           # no shrinking backend here: abort instead
    assert keeper.fail([1], shrink_id=1) == {"shrunk": False, "aborted": True}
    assert calls == ["_abort_process_group"] and not dist.is_initialized()
    keeper.leave()                                   # the training thread's reset after it: nothing left
    assert calls == ["_abort_process_group"]


def test_the_nccl_watchdog_reports_instead_of_killing():
    env = {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "999"}   # a run's own setting stays
    got = group_failure.watchdog_env(30.0, env)
    assert got == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                   "TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "999"}
    assert group_failure.watchdog_env(30.0, {})["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "120"


def test_the_step_guard_aborts_a_step_past_the_timeout_and_the_step_raises():
    expired = []
    release = threading.Event()

    def on_expiry(what):
        expired.append(what)
        release.set()   # what an abort does to a collective blocked on a dead peer

    guard = StepGuard(on_expiry)
    with guard.watch("step 1", 5.0):
        pass                                        # in time: nothing happens
    with pytest.raises(CollectiveTimeout, match=r"step 2 was ended: it ran past its timeout \(0.2 s\)"):
        with guard.watch("step 2", 0.2):
            assert release.wait(30.0)               # blocked until the guard aborts
    assert expired == ["step 2"]
    release.clear()
    with pytest.raises(CollectiveTimeout):          # a step that raised after the abort says why
        with guard.watch("step 3", 0.1):
            assert release.wait(30.0)               # the abort ends the collective, which raises
            raise RuntimeError("NCCL communicator was aborted")
    assert expired == ["step 2", "step 3"]
    with guard.watch("step 4", 5.0):                # armed afresh each step
        pass
    with pytest.raises(CollectiveTimeout, match="step 5 was ended: the controller ended"):
        with guard.watch("step 5", 5.0):            # ended from outside: it raises, whatever it returned
            guard.trip("the controller ended its collectives")
    guard.trip("between steps: nothing to end")
    with guard.watch("step 6", 5.0):
        pass
    guard.close()


def test_the_controllers_abort_fails_the_step_in_flight(gloo_world, calls, monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    keeper = GroupKeeper("test")
    keeper.backend = "nccl"
    inside, done = threading.Event(), threading.Event()
    raised = []

    def step():
        try:
            with keeper.guarded("step 7", 60.0):
                inside.set()
                done.wait(5.0)   # blocked on the GPU, until the abort ends the kernels
        except CollectiveTimeout as e:
            raised.append(str(e))

    t = threading.Thread(target=step)
    t.start()
    assert inside.wait(5.0)
    assert keeper.fail([], None) == {"shrunk": False, "aborted": True}
    done.set()
    t.join(5.0)
    assert calls == ["_abort_process_group"] and raised and "step 7 was ended" in raised[0]


def test_gloo_steps_are_not_guarded():
    keeper = GroupKeeper("test")
    keeper.backend = "gloo"
    with keeper.guarded("step 1"):
        pass
    assert keeper._guard is None


def test_the_shrink_drops_whole_replicas_and_keeps_the_survivors_stages():
    topo = Topology(3, 2)                            # rank = replica * 2 + stage
    ranks = {r: 10 + r for r in range(6)}
    assert exclusion(topo, ranks, [3]) == ([2, 3], [12])   # replica 1 goes; its stage 0 becomes a spare
    bounds = [(0, 3), (3, 6)]
    old = Plan(topo, bounds, [1, 1], 1)
    shrunk = ShrunkWorld(1, {10: 0, 11: 1, 14: 2, 15: 3}, 2, bounds)
    alive = {10, 11, 14, 15}
    assert shrunk_ranks(shrunk, Plan(Topology(2, 2), bounds, [1, 1], 1), alive) == {0: 10, 1: 11, 2: 14, 3: 15}
    assert shrunk_ranks(shrunk, Plan(Topology(2, 2), [(0, 2), (2, 6)], [1, 1], 1), alive) is None  # other stages
    assert shrunk_ranks(shrunk, Plan(Topology(4, 1), [(0, 6)], [1], 1), alive) is None    # another layout
    assert shrunk_ranks(shrunk, Plan(Topology(2, 2), bounds, [1, 1], 1), alive - {14}) is None  # one left since
    assert shrunk_ranks(None, old, alive) is None


class _Pool:
    """The worker pool's ``ask`` as survivors on a shrinking backend answer it."""

    def __init__(self, alive, shrinks=True):
        self.alive, self.shrinks, self.asked = set(alive), shrinks, []

    def __contains__(self, w):
        return w in self.alive

    def ask(self, method, wids, timeout, excluded, shrink_id, shrink_timeout):
        self.asked.append((sorted(wids), excluded, shrink_id))
        if not excluded or not self.shrinks:
            return {w: {"shrunk": False, "aborted": True} for w in wids}
        keep = sorted(w for w in wids)
        return {w: {"shrunk": True, "rank": keep.index(w), "world_size": len(keep)} for w in wids}


def test_survivors_are_told_to_end_their_collectives_on_nccl_only():
    topo, ranks = Topology(2, 2), {0: 10, 1: 11, 2: 12, 3: 13}
    pool = _Pool({10, 11, 12})
    assert end_collectives(pool, "gloo", topo, ranks, [3], [(0, 1), (1, 2)], 1, 5.0) is None
    assert pool.asked == []                           # a dead peer's sockets close: nothing to ask
    silent = _Pool({10, 11, 12})
    assert end_collectives(silent, "gloo", topo, ranks, [3], [(0, 1), (1, 2)], 1, 5.0, silent=True) is None
    assert silent.asked == [([10, 11, 12], [], None)]  # a frozen one's stay open: every survivor cuts its own
    shrunk = end_collectives(pool, "nccl", topo, ranks, [3], [(0, 1), (1, 2)], 1, 5.0)
    assert pool.asked == [([12], [], None), ([10, 11], [2, 3], 1)]   # 12 (replica 1) aborts; 10, 11 shrink
    assert shrunk.ranks == {10: 0, 11: 1} and shrunk.pp == 2
    no_shrink = _Pool({10, 11, 12}, shrinks=False)
    assert end_collectives(no_shrink, "nccl", topo, ranks, [3], [(0, 1), (1, 2)], 2, 5.0) is None
    # Nobody lost (a step raised, a collective failed): every survivor aborts, nobody shrinks.
    everyone = _Pool({10, 11, 12, 13})
    assert end_collectives(everyone, "nccl", topo, ranks, [], [(0, 1), (1, 2)], 3, 5.0) is None
    assert everyone.asked == [([10, 11, 12, 13], [], None)]
    # Rank 0 lost: it hosted the world's store, which a shrink needs, so everyone aborts.
    no_store = _Pool({11, 12, 13})
    assert end_collectives(no_store, "nccl", topo, ranks, [0], [(0, 1), (1, 2)], 4, 5.0) is None
    assert no_store.asked == [([11, 12, 13], [], None)]


def test_a_worker_drives_the_gpu_ray_gave_it():
    assert device_index("3", None) == 3
    assert device_index(3, "2,3") == 1               # the node itself restricts what it shows
    with pytest.raises(ValueError, match="'5' assigned by Ray is not in CUDA_VISIBLE_DEVICES='2,3'"):
        device_index("5", "2,3")
    assert worker_device(["1"], "0,1", cuda_available=True) == torch.device("cuda", 1)
    assert worker_device([], None, cuda_available=True) == torch.device("cpu")
    assert worker_device(["0"], None, cuda_available=False) == torch.device("cpu")
