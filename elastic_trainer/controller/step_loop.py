"""The step loop: issue a step (or a lease of steps) on every rank, wait for it, record it.

A step that completed on every rank is recorded (``commit``): its history
record, each rank's pace and the balancing it calls for, the metrics, its
snapshot and the durable checkpoint due. A step that failed goes to
``Recovery.recover``. With leases (``control.lease_steps``; ``auto``, the
default, sizes them to about a second of steps) the next lease
is granted while the last one still runs, queued behind it on every rank
(``control.renew_early``; else as soon as it completes), and always before
its steps are recorded (``_renew``, docs/runtime.md "Leases"): the workers
run while the controller gathers and records them.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING

from .leases import lease_length, schedule_after
from .rank_figures import split_rank_figures
from .stepping import StepOutcome

if TYPE_CHECKING:
    from .controller import Controller

log = logging.getLogger(__name__)


class StepLoop:
    def __init__(self, ctl: "Controller"):
        self.ctl = ctl

    def run(self) -> None:
        """Until the last step, a stop or an error: issue, wait, record; a failure goes to recovery."""
        ctl = self.ctl
        granted: collections.deque[StepOutcome] = collections.deque()   # the running lease, then one queued behind
        while granted or not ctl._stop.is_set():
            if not granted:
                if ctl.evaluator.due():
                    ctl.evaluator.run()
                    continue
                if ctl.step >= ctl.cfg.train.steps:
                    break
                ctl.recovery.maybe_grow()
                step = ctl.step + 1
                if ctl._error_at is not None and ctl._error_at in (step, 0):
                    raise RuntimeError(f"injected controller error at step {step}")
                count = self.lease_at(step)
                granted.append(self._issue(step, count))
            if len(granted) == 1 and ctl.cfg.control.renew_early:
                renewal = self._renew(granted[0], running=True)
                if renewal is not None:
                    granted.append(renewal)
            out = ctl.driver.finish(granted.popleft())
            if not out.ok:
                for queued in granted:
                    # Refused at once where ``out`` failed; where it completed, blocked in its first
                    # collective until recovery cuts the groups: a step still running, either way.
                    out.inflight.update(queued.calls[0])
                    out.dropped.append((queued.step, queued.step + queued.count - 1))
                granted.clear()
                ctl.recovery.recover(out)
                continue
            steps = ctl.driver.split(out)
            if granted:
                ctl.driver.running(granted[0])
            else:
                renewal = self._renew(out, running=False)
                if renewal is not None:
                    granted.append(renewal)
            for one in steps:
                self.commit(one)

    def _issue(self, step: int, count: int, snapshots_pending: int = 0, after: int | None = None,
               snapshot_step: int | None = None) -> StepOutcome:
        """Start ``count`` steps from ``step`` on every rank (``StepDriver.start``);
        ``snapshot_step``: that of a snapshot granted before it and not yet recorded."""
        ctl = self.ctl
        snap = schedule_after(ctl.schedule, snapshot_step).due(step + count - 1)
        writers = ctl.snapshots.writers(snapshots_pending)
        return ctl.driver.start(step, {w: ctl.pool[w].actor for w in ctl.ranks.values()}, snap,
                                {w: writers[r] for r, w in ctl.ranks.items()} if snap else None,
                                ctl.balance.shares, count=count, after=after)

    def _renew(self, lease: StepOutcome, running: bool) -> StepOutcome | None:
        """The lease after ``lease``, granted before ``lease``'s steps are recorded: with
        ``running``, while ``lease`` still runs, queued behind it on every rank
        (``control.renew_early``), so no rank waits for the controller between leases; else
        once its results are in, so the ranks run while the controller records them. Either
        way the O(ranks) work a step costs the controller (pace, metrics, history, snapshot
        bookkeeping) is off the step's critical path. Only where nothing must come between:
        no evaluation, stop, re-plan or look for joined workers due, and not step by step (a
        lease of one keeps today's driving). What the steps before it decide (shares, a re-plan)
        takes effect a lease later."""
        ctl = self.ctl
        first = lease.step + lease.count
        if (lease.count <= 1 or first > ctl.cfg.train.steps or ctl._stop.is_set()
                or ctl.evaluator.due_after(first - 1)
                or self.one_step_at_a_time() or not ctl.recovery.quiet() or ctl.schedule.requested):
            return None
        # ``lease``'s snapshot is not yet recorded: the next snapshot step counts from it, and
        # the snapshot parts asked for are those of the turn after it.
        pending = first - 1 if lease.snapshot else None
        count = self.lease_at(first, pending)
        if count <= 1:
            return None
        return self._issue(first, count, snapshots_pending=1 if lease.snapshot else 0,
                           after=lease.grant if running else None, snapshot_step=pending)

    def lease_at(self, first: int, snapshot_pending: int | None = None) -> int:
        """Steps the lease from ``first`` holds now (``leases.lease_length``): with
        ``lease_steps: auto``, as many as fit about a second at the step time measured under
        the plan in force. ``snapshot_pending``: the step of a snapshot granted and not yet
        recorded (a lease granted ahead)."""
        ctl = self.ctl
        return lease_length(ctl.cfg, first, ctl.schedule, self.one_step_at_a_time(), ctl.driver.median_step_s(),
                            snapshot_pending)

    def one_step_at_a_time(self) -> bool:
        """Whether the next steps must run without a lease: during warm-up (its step times set
        the timeouts), with a parameter server (it keeps per-step state of its own), with a
        controller fault armed, and while a re-plan waits for its snapshot step."""
        ctl = self.ctl
        return (ctl.ps is not None or ctl._error_at is not None or ctl.recovery.replan_pending()
                or ctl.driver.steps_since_setup < ctl.cfg.failure.warmup_steps)

    def commit(self, out: StepOutcome) -> None:
        """Record a step that completed on every rank: its record, pace and balancing, metrics,
        snapshot and durable checkpoint."""
        ctl = self.ctl
        cfg, step = ctl.cfg, out.step
        record = ctl.driver.record(out, ctl.plan.topology, len(ctl.plans) - 1)
        where = {r: (w, ctl.pool[w].node if w in ctl.pool else None) for r, w in ctl.ranks.items()}
        named = False
        for ev in ctl.balance.observe(step, out.results, record, where, out.shares):
            named = named or ev["kind"] == "straggler"
            ctl.event(ev.pop("kind"), **ev)
        try:
            for ev in ctl.balance.act(step, named) + ctl.bench.poll(step):
                ctl.event(ev.pop("kind"), **ev)
            if ctl.balance.bench_request:
                rank, pace = ctl.balance.bench_request
                ctl.balance.bench_request = None
                ctl.bench.bench(rank, pace, step)
            if ctl.balance.cut_request:
                # A re-plan already asked for (a straggler benched) goes first; it changes the
                # workers, and with them the balancing starts again.
                if not ctl.recovery.replan_pending():
                    ctl.recovery.request_replan("recut", cut=ctl.balance.cut_request)
                ctl.balance.cut_request = None
        except Exception as e:  # noqa: BLE001 - working around a straggler must never end the run
            log.warning("[%s] balancing failed at step %d, the run goes on without it: %s", ctl.run_name, step, e,
                        exc_info=True)
            ctl.event("balance_problem", step=step, detail=f"{type(e).__name__}: {e}")
        # What driving the run has cost so far, in actor calls (this step's snapshot pins, issued
        # below, count in the next record).
        record["actor_calls"] = ctl.driver.calls + ctl.snapshots.calls
        # The controller process's CPU seconds so far (Ray's threads sending and taking its calls
        # included): what driving costs where its wall time also waits for a core.
        record["controller_cpu_s"] = time.process_time()
        record["heartbeats"] = ctl.driver.heartbeats
        figures = split_rank_figures(record)
        with ctl._lock:
            ctl.history.append(record)
            ctl.rank_figures.append(figures)
            ctl.step = step
        ctl.recovery.step_committed()
        ctl.metrics.record_step({**record, **figures})
        choice = ctl.schedule.observe(step, record["step_time_s"])
        if choice:
            ctl.event("snapshot_interval", **choice)
        if out.snapshot:
            ctl.schedule.taken(step)
            ranks = {r: ctl.pool[w] for r, w in ctl.ranks.items()}
            ctl.snapshots.take_step(step, ranks, out.shard_refs,
                                    nbytes=sum(o.get("snapshot_bytes", 0) for o in out.results.values()),
                                    results=out.results)
            if ctl.ps:
                ctl.ps.snapshot(step)
        for snap in ctl.snapshots.poll():
            # Not a result event (one per step would drown the others): a metric only.
            ctl.metrics.record_event({"kind": "snapshot", "step": snap.step, "bytes": snap.nbytes,
                                      "seconds": snap.committed_at - snap.started})
        for snap in ctl.snapshots.take_dropped():
            ctl.event("snapshot_dropped", step=snap.step, reason=snap.dropped)
        ctl.snapshots.prune()
        if ctl.ps:
            ctl.ps.retain(ctl.snapshots.steps())
        if ctl.writer and cfg.checkpoint.durable_every and step % cfg.checkpoint.durable_every == 0 \
                and step < cfg.train.steps:
            ctl.writer.start(step, list(ctl.history), ctl.plan.describe())
