"""A re-plan is decided as a value (``ReplanOrder``) by growth or recovery, and carried out by the
``Replanner`` alone: growth waits for a snapshot step before it orders one, and a set-up that fails
counts as a failure, drops what the failed attempt left in no known state, and starts over."""

from types import SimpleNamespace

import pytest

from elastic_trainer import RunError, TrainerConfig
from elastic_trainer.controller.failures.failure_budget import FailureBudget
from elastic_trainer.controller.replanning.growth import Growth
from elastic_trainer.controller.replanning.replan import Replanner
from elastic_trainer.controller.run.orders import ReplanOrder
from elastic_trainer.controller.run.run_record import RunRecord
from elastic_trainer.controller.run.run_state import RunState, RunStateMachine
from elastic_trainer.controller.state.snapshot_schedule import SnapshotSchedule
from elastic_trainer.errors import WorkerError
from elastic_trainer.models.factory import block_param_counts
from elastic_trainer.planning.plan import plan_for

from ..conftest import tiny_config


class _Pool:
    def __init__(self, wids):
        self.workers = {w: SimpleNamespace(rank=w, node=f"n{w}", wid=w) for w in wids}
        self.dropped = []
        self.draining = {}
        self.quarantined, self.quarantined_workers, self.joining = {}, set(), {}

    def handles(self):
        return list(self.workers.values())

    def __len__(self):
        return len(self.workers)

    def __getitem__(self, wid):
        return self.workers[wid]

    def __contains__(self, wid):
        return wid in self.workers

    def await_joining(self, timeout, required=False):
        return []

    def spawn_on_free_nodes(self):
        pass

    def dead_or_silent(self, wids):
        return [], []

    def drop(self, wids, answered=False):
        self.dropped += list(wids)


class _Setup:
    """Fails the first ``fail`` set-ups as a member lost at the rendezvous would."""

    def __init__(self, fail=0):
        self.fail, self.calls, self.aborted = fail, [], 0
        self.setup_timings, self.restore_moved, self.reset_refs = {}, {}, {}

    def apply(self, plan, restore, sources, durable_refs, ranks=None, reuse_world=None, whole=None):
        self.calls.append({"ranks": ranks, "reuse_world": reuse_world, "whole": whole, "restore": restore})
        if len(self.calls) <= self.fail:
            raise WorkerError("rendezvous: a member did not arrive")
        return plan.describe()

    def abort(self):
        self.aborted += 1


def _run(state=RunState.RUNNING, workers=(0, 1)):
    cfg = TrainerConfig.from_dict(tiny_config("/nonexistent", parallel={"dp": 1, "pp": 2}))
    run = RunRecord(cfg, "orders")
    run.counts = block_param_counts(cfg.model)
    run.plan = plan_for(cfg, 1, 2, [(0, 4), (4, len(run.counts))], run.counts)
    run.ranks = {r: w for r, w in enumerate(workers)}
    run.step = 8
    run.machine = RunStateMachine(state)
    return cfg, run


def _replanner(cfg, run, setup, pool):
    bench = SimpleNamespace(usable=lambda: list(pool.workers), benched=set(), after_replan=lambda step, refs: None)
    points = SimpleNamespace(restore_point=lambda between_steps=False, at_most=None: (8, {}, {"0": "memory"}),
                             sources=None,
                             durable_refs=None, holder_reads=0, relayed_reads=0)
    budget = FailureBudget(cfg, emergency=lambda why: None)
    fences = SimpleNamespace(fence=lambda wids, *where: None)
    memory = SimpleNamespace(poll=lambda: [])   # no memory kill found
    return Replanner(cfg, run, pool, bench, setup, points, budget, fences, memory), budget


def test_growth_orders_a_replan_asked_for_only_at_a_snapshot_step_and_forgets_it_once_carried_out():
    cfg, run = _run()
    pool = _Pool([0, 1])
    schedule = SnapshotSchedule(cfg)
    schedule.taken(5)   # the last snapshot is older than the last step: one is asked for first
    bench = SimpleNamespace(usable=lambda: list(pool.workers))
    growth = Growth(cfg, run, pool, bench, schedule, SimpleNamespace(poll=lambda: []))
    cut = ((0, 3), (3, len(run.counts)))
    growth.request_replan("recut", cut=cut)
    assert growth.maybe_grow() is None and schedule.requested and growth.replan_pending()
    assert run.state is RunState.RUNNING   # nothing moved yet
    schedule.taken(run.step)
    order = growth.maybe_grow()
    assert isinstance(order, ReplanOrder)
    assert (order.reason, order.cut, order.failed, order.after_failure) == ("recut", cut, None, False)
    assert order.plan_before["stages"][0]["blocks"] == [0, 4] and run.state is RunState.RESIZING
    # Carried out by the replanner (here: every rank keeps its worker, with the new cut).
    setup = _Setup()
    _replanner(cfg, run, setup, pool)[0].carry_out(order)
    assert setup.calls[0]["ranks"] == {0: 0, 1: 1} and setup.calls[0]["whole"] is None
    growth.replanned()
    assert not growth.replan_pending() and run.state is RunState.RUNNING
    assert not [e for e in run.events if e["kind"] == "recovery"]   # shown once its first step completes it
    [ev] = [e for e in run._held if e["kind"] == "recovery"]
    assert ev["reason"] == "recut" and ev["policy"].startswith("re-cut") and ev["restored_step"] == 8


def test_a_failed_setup_counts_drops_the_groups_it_carried_and_starts_over():
    cfg, run = _run(RunState.RECOVERING)
    pool = _Pool([0, 1])
    setup = _Setup(fail=1)
    replanner, budget = _replanner(cfg, run, setup, pool)
    failed = SimpleNamespace(step=9, started=0.0, dropped=[], first_signal=None)
    order = ReplanOrder("death", detected=0.5, failed=failed, plan_before=run.plan.describe(),
                        whole={"g0"}, settle_wait={"settle_wait_s": 0.1, "settle_wait_end": "all"})
    replanner.carry_out(order)
    assert [c["whole"] for c in setup.calls] == [{"g0"}, set()]   # the retry carries nothing
    assert setup.aborted == 1 and budget.failures == 1
    assert [e["failure"] for e in run.events if e["kind"] == "failure"] == ["during_recovery"]
    ev = replanner.pending_event
    assert (ev["reason"], ev["failed_step"], ev["attempts"], ev["settle_wait_end"]) == ("death", 9, 2, "all")
    assert run.state is RunState.RUNNING
    # A driver reads each event once: the recovery is not shown until its first step completes it.
    # (Before, it was shown at once and completed in place, without the lock: a driver that had
    # read it kept it without first_step_s and total_s.)
    seen = run.events[:]
    assert ev not in seen
    replanner.step_committed()
    assert replanner.pending_event is None and ev["total_s"] >= ev["detect_s"]
    [shown] = [e for e in run.events[len(seen):] if e["kind"] == "recovery"]
    assert shown is ev and "_resumed" not in shown and shown["first_step_s"] >= 0


def test_setups_that_keep_failing_end_the_run_at_its_limit():
    cfg, run = _run(RunState.RECOVERING)
    setup = _Setup(fail=100)
    replanner, budget = _replanner(cfg, run, setup, _Pool([0, 1]))
    with pytest.raises(RunError, match=rf"stopped after {cfg.failure.max_failures + 1} failures .*during_recovery"):
        replanner.carry_out(ReplanOrder("startup", detected=0.0, abort_setups=True))
    # One abort before the first attempt (the start-up's set-ups), one after each failed attempt retried.
    assert len(setup.calls) == cfg.failure.max_failures + 1 and setup.aborted == len(setup.calls)


def test_a_memory_kill_found_during_a_replan_names_its_own_failures_recovery_not_another():
    cfg, run = _run(RunState.RECOVERING)
    pool = _Pool([0, 1])
    replanner, _ = _replanner(cfg, run, _Setup(), pool)
    earlier = run.event("recovery", reason="death", cause=None, failure=1, failed_step=3)
    kills = [{"kind": "memory_kill", "worker": 5, "step": 3, "failure": 1},
             {"kind": "memory_kill", "worker": 7, "step": 9, "failure": 2}]
    replanner.memory = SimpleNamespace(poll=lambda: [kills.pop(0)] if kills else [])
    failed = SimpleNamespace(step=9, started=0.0, dropped=[], first_signal=None)
    replanner.carry_out(ReplanOrder("death", detected=0.5, failed=failed, failure=2))
    assert earlier["cause"] == "memory"   # found late: named on the recovery it belongs to
    ev = replanner.pending_event
    assert (ev["failure"], ev["cause"]) == (2, "memory")
    assert [e["worker"] for e in run.events if e["kind"] == "memory_kill"] == [5, 7]


class _OomSetup(_Setup):
    """Runs out of memory setting up ``unfit`` (dp, pp) layouts; any other sets up."""

    def __init__(self, unfit):
        super().__init__()
        self.unfit = unfit

    def apply(self, plan, restore, sources, durable_refs, ranks=None, reuse_world=None, whole=None):
        self.calls.append({"layout": (plan.topology.dp, plan.topology.pp), "ranks": ranks})
        if (plan.topology.dp, plan.topology.pp) in self.unfit:
            raise WorkerError("workers failed to set up: worker 0: OutOfMemoryError: CUDA out of memory. "
                              "Tried to allocate 2.00 GiB")
        return plan.describe()


def test_a_layout_that_runs_out_of_memory_at_its_setup_is_not_retried_nor_chosen_again():
    cfg, run = _run(RunState.RECOVERING)
    setup = _OomSetup(unfit={(1, 2)})
    replanner, budget = _replanner(cfg, run, setup, _Pool([0, 1]))
    failed = SimpleNamespace(step=9, started=0.0, dropped=[], first_signal=None)
    # Every worker is alive, so the plan would be kept as it is: it ran out of memory, so the
    # policy chooses again, leaving it out.
    replanner.carry_out(ReplanOrder("raised", detected=0.5, failed=failed, plan_before=run.plan.describe()))
    assert [c["layout"] for c in setup.calls] == [(1, 2), (2, 1)] and budget.failures == 1
    [unfit] = [e for e in run.events if e["kind"] == "layout_unfit"]
    assert (unfit["dp"], unfit["pp"]) == (1, 2) and "out of memory" in unfit["detail"]
    assert list(replanner.unfit) == [(1, 2, ((0, 4), (4, len(run.counts))))]


def test_a_recovery_no_step_completed_is_shown_as_it_is_when_the_next_one_starts_or_the_run_ends():
    cfg, run = _run(RunState.RECOVERING)
    pool = _Pool([0, 1])
    replanner, _ = _replanner(cfg, run, _Setup(), pool)
    failed = SimpleNamespace(step=9, started=0.0, dropped=[], first_signal=None)
    replanner.carry_out(ReplanOrder("death", detected=0.5, failed=failed, failure=1))
    first = replanner.pending_event
    run.machine = RunStateMachine(RunState.RECOVERING)
    replanner.carry_out(ReplanOrder("death", detected=0.7, failed=failed, failure=2))
    assert first in run.events and first["first_step_s"] is None and first["total_s"] is None
    replanner.flush()
    assert [e["failure"] for e in run.events if e["kind"] == "recovery"] == [1, 2] and not run._held


def test_a_sharded_slice_lost_before_the_final_save_is_a_failure_to_recover_not_a_failed_save():
    from elastic_trainer.controller.failures.recovery import Recovery

    cfg = TrainerConfig.from_dict(tiny_config("/nonexistent", parallel={"dp": 2, "pp": 1}))
    run = RunRecord(cfg, "end")
    run.counts = block_param_counts(cfg.model)
    run.plan = plan_for(cfg, 2, 1, [(0, len(run.counts))], run.counts)
    run.ranks, run.step = {0: 0, 1: 1}, 16
    run.machine = RunStateMachine(RunState.RUNNING)
    pool = _Pool([0, 1])
    pool.dead_or_silent = lambda wids: ([], [1])          # worker 1 froze after the last step
    fenced = []
    fences = SimpleNamespace(fence=lambda wids, *where: fenced.extend(wids))
    recovery = Recovery(cfg, run, pool, FailureBudget(cfg, emergency=lambda why: None), fences,
                        SimpleNamespace(watch=lambda *a: None), lambda: None)
    # Unsharded: the other replica holds the whole stage, the save reads it; nothing to recover.
    assert recovery.lost_before_save() is None and run.state is RunState.RUNNING
    # Sharded: worker 1 held the only copy of its slice of the moments. Before, the final save
    # failed the run (or, earlier still, wrote a checkpoint a resume refused).
    run.plan.shard_optimizer = "gradients"
    order = recovery.lost_before_save()
    assert order is not None and order.reason == "silent" and not order.after_failure
    assert fenced == [1] and run.state is RunState.RECOVERING
    assert [(e["failure"], e["worker"], e["step"]) for e in run.events if e["kind"] == "failure"] == [("silent", 1, 16)]


def test_a_drain_moves_the_leaving_rank_to_a_spare_and_keeps_the_layout_and_every_other_rank():
    cfg, run = _run(RunState.RESIZING)
    pool = _Pool([0, 1, 2])   # worker 2: a replacement holding no rank
    pool.workers[2].rank = None
    setup = _Setup()
    replanner, _ = _replanner(cfg, run, setup, pool)
    replanner.bench.usable = lambda: [0, 2]   # worker 1's node is draining
    replanner.carry_out(ReplanOrder("drain", 0.0, plan_before=run.plan.describe()))
    [call] = setup.calls
    assert call["ranks"] == {0: 0, 1: 2}, call   # rank 1 moved to the spare, rank 0 stayed
    assert call["restore"][0] == 8   # from the snapshot of the step just ended: nothing redone
    # Without a spare to take the leaving rank, the policy chooses on the workers there are.
    cfg, run = _run(RunState.RESIZING)
    setup = _Setup()
    replanner, _ = _replanner(cfg, run, setup, _Pool([0, 1]))
    replanner.bench.usable = lambda: [0]
    replanner.carry_out(ReplanOrder("drain", 0.0, plan_before=run.plan.describe()))
    assert setup.calls[0]["ranks"] is None
