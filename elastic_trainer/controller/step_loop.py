"""The step loop: issue a step (or a lease of steps) on every rank, wait for it, record it.

A step that completed on every rank is recorded (``commit``): its history
record, each rank's pace and the balancing it calls for, the metrics, its
snapshot and the durable checkpoint due. A step that failed goes to
``Recovery.recover``, whose re-plan order ``Replanner`` carries out, as it does
growth's (``Growth.maybe_grow``). With leases (``control.lease_steps``; ``auto``, the
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
from typing import Callable

from ..config import TrainerConfig
from .balance.stragglers import Balance, Moves
from .balance.benching import Bench
from .state.durable_writer import DurableWriter
from .stepping.evaluation import Evaluator
from .stepping.leases import lease_length, schedule_after
from .failures.memory_kills import MemoryKills
from .integrity.anomalies import Anomalies
from .integrity.corruption import Corruption
from .run.ps_group import ParameterServers
from .run.rank_figures import split_rank_figures
from .replanning.growth import Growth
from .failures.recovery import Recovery
from .replanning.replan import Replanner
from .run.orders import ReplanOrder
from .run.run_record import RunRecord
from .run.run_state import RunState
from .state.snapshot_schedule import SnapshotSchedule
from .state.snapshots import SnapshotStore
from .stepping.one_step import StepDriver, StepOutcome
from .run.workers import WorkerPool

log = logging.getLogger(__name__)

_LAST_ANSWER_S = 10.0


class StepLoop:
    """The one loop that carries the parts' decisions out, in this order each turn: an evaluation
    due, the last step reached or a stop, growth or a re-plan asked for, then the next step or
    lease; what completed is recorded (``commit``), what failed goes to ``Recovery.recover``, and
    the re-plan that it or growth orders is carried out (``replan``)."""

    def __init__(self, cfg: TrainerConfig, run: RunRecord, pool: WorkerPool, driver: StepDriver,
                 balance: Balance, bench: Bench, snapshots: SnapshotStore, schedule: SnapshotSchedule,
                 recovery: Recovery, growth: Growth, replanner: Replanner, evaluator: Evaluator,
                 writer: DurableWriter | None, ps: Callable[[], ParameterServers | None],
                 memory: MemoryKills | None = None, anomalies: Anomalies | None = None,
                 corruption: Corruption | None = None):
        self.cfg, self.run, self.pool, self.driver = cfg, run, pool, driver
        self.anomalies = anomalies or Anomalies(cfg, run)
        # The controller hands in both; a loop built bare (a test of its other parts) makes its own.
        self.corruption = corruption or (Corruption(cfg, run, pool, lambda why: growth.request_replan(why),
                                                    lambda: driver.median_step_s()) if cfg is not None else None)
        self._replay: ReplanOrder | None = None   # a mismatch's replay, carried out before the next step
        self.balance, self.bench, self.snapshots, self.schedule = balance, bench, snapshots, schedule
        self.recovery, self.growth, self.replanner = recovery, growth, replanner
        self.evaluator, self.writer, self._ps, self.memory = evaluator, writer, ps, memory

    def loop(self) -> None:
        """Until the last step, a stop or an error: issue, wait, record; a failure goes to recovery."""
        run, driver = self.run, self.driver
        granted: collections.deque[StepOutcome] = collections.deque()   # the running lease, then one queued behind
        last_done = 0.0   # when the last lease completed
        while granted or not run.stopping:
            if not granted:
                if self.evaluator.due():
                    with run.goodput.phase("evaluation"):
                        done = self.evaluator.run_after_step()
                    if not done.ok:
                        self.replan(self.recovery.recover(done))
                    continue
                if self._replay is not None:   # silent corruption found: replay to prove who (integrity)
                    order, self._replay = self._replay, None
                    run.transition(RunState.RECOVERING, step=order.failed.step)
                    run.goodput.enter("replan")
                    self.replan(order)
                    continue
                if run.step >= self.cfg.train.steps:
                    break
                run.points.reach("between_steps", step=run.step)
                order = self.growth.maybe_grow()
                if order is not None:
                    self.replan(order)
                step = run.step + 1
                if run.error_due(step):
                    raise RuntimeError(f"injected controller error at step {step}")
                count = self.lease_at(step)
                granted.append(self._issue(step, count))
                run.points.reach("in_step", step=step, steps=count)
            if len(granted) == 1 and self.cfg.control.renew_early:
                renewal = self._renew(granted[0], running=True)
                if renewal is not None:
                    granted.append(renewal)
            out = driver.finish(granted.popleft())
            if not granted:
                run.goodput.enter("controller")   # no step runs until the next is issued
            if not out.ok:
                for queued in granted:
                    # Refused at once where ``out`` failed; where it completed, blocked in its first
                    # collective until recovery cuts the groups: a step still running, either way.
                    out.inflight.update(queued.calls[0])
                    out.dropped.append((queued.step, queued.step + queued.count - 1))
                granted.clear()
                # The failed step's time, from its start (or the last step's end, where it was
                # granted behind it) until the failure was known, is lost.
                run.goodput.move("training", "detection", time.perf_counter() - max(out.started, last_done))
                run.goodput.enter("replan")
                self.replan(self.recovery.recover(out))
                continue
            last_done = time.perf_counter()
            mark = self.anomalies.take(out)
            if mark is not None:
                # Every rank judged a step alike and applied it nowhere, and ended its lease there:
                # what was asked after it (the lease's snapshot, a lease queued behind) never runs.
                self.recovery.abandon([r for r in out.shard_refs.values() if r is not None]
                                      + [ref for q in granted for ref in q.calls[0]])
                out.shard_refs = {}
                granted.clear()
            steps = driver.split(out) if out.count else []
            if granted:
                driver.running(granted[0])
            elif mark is None:
                renewal = self._renew(out, running=False)
                if renewal is not None:
                    granted.append(renewal)
            for one in steps:
                replay = self.commit(one)
                if replay is not None:
                    self._replay = replay   # carried out before the next step is issued
            if mark is not None:
                order = self.anomalies.order(mark, out)
                if order is not None:
                    run.goodput.enter("replan")
                    self.replan(order)
        # A death's cause still being asked of its node is worth a short wait: the run's record
        # should say why it lost a worker (a fenced one's death too, read here at the latest).
        self.growth.poll_fences()
        self._memory_kills(wait_s=_LAST_ANSWER_S)

    def replan(self, order: ReplanOrder) -> None:
        """Carry out a re-plan order (a failure's, growth's, or the start-up's): it also does what
        growth had asked for, which is then no longer pending."""
        if order.cut is None:
            # A re-cut asked for and not yet taken is taken by any re-plan (where it still fits).
            order.cut = self.growth.pending_cut()
        self.replanner.carry_out(order)
        self.growth.replanned()

    def _memory_kills(self, wait_s: float = 0.0) -> None:
        """Record the memory kills found since the recoveries' events were (``memory_kills``)."""
        for ev in self.memory.poll(wait_s) if self.memory else ():
            self.run.event(ev.pop("kind"), **ev)
            self.run.name_cause(ev["failure"], "memory")

    def _issue(self, step: int, count: int, snapshots_pending: int = 0, after: int | None = None,
               snapshot_step: int | None = None) -> StepOutcome:
        """Start ``count`` steps from ``step`` on every rank (``StepDriver.start``);
        ``snapshot_step``: that of a snapshot granted before it and not yet recorded."""
        ranks = self.run.ranks
        self.run.goodput.enter("training")
        snap = schedule_after(self.schedule, snapshot_step).due(step + count - 1)
        writers = self.snapshots.writers(snapshots_pending)
        return self.driver.start(step, {w: self.pool[w].actor for w in ranks.values()}, snap,
                                 {w: writers[r] for r, w in ranks.items()} if snap else None,
                                 self.balance.shares, count=count, after=after,
                                 checks=self.corruption.checks(step, count, snap))

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
        first = lease.step + lease.count
        if (lease.count <= 1 or first > self.cfg.train.steps or self.run.stopping or self._replay is not None
                or self.evaluator.due_after(first - 1)
                or self.one_step_at_a_time() or not self.growth.quiet() or self.schedule.requested):
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
        return lease_length(self.cfg, first, self.schedule, self.one_step_at_a_time(), self.driver.median_step_s(),
                            snapshot_pending)

    def one_step_at_a_time(self) -> bool:
        """Whether the next steps must run without a lease: during warm-up (its step times set
        the timeouts), with a parameter server (it keeps per-step state of its own), with a
        controller fault armed, while a re-plan waits for its snapshot step, and while a node
        given too short a notice to move off has yet to go (``Drains.losing``)."""
        return (self._ps() is not None or self.run.error_at is not None or self.growth.replan_pending()
                or self.growth.drains.losing() or self.driver.steps_since_setup < self.cfg.failure.warmup_steps)

    def _carry_out(self, moves: Moves, step: int) -> None:
        """Ask growth for the re-plan a balancing decision calls for: without the straggler
        left out as a spare, or onto a re-cut."""
        try:
            if moves.bench is not None:
                if self.bench.bench(*moves.bench, step) is not None:
                    self.growth.request_replan("straggler")
                else:
                    self.balance.bench_refused()   # its worker is gone: nothing to leave out
            if moves.cut is not None and not self.growth.replan_pending():
                # A re-plan already asked for (a straggler benched) goes first; it changes the
                # workers, and with them the balancing starts again.
                self.growth.request_replan("recut", cut=moves.cut)
        except Exception as e:  # noqa: BLE001 - as in commit
            self._balance_failed(step, e)

    def _balance_failed(self, step: int, e: Exception) -> None:
        log.warning("[%s] balancing failed at step %d, the run goes on without it: %s", self.run.name, step, e,
                    exc_info=True)
        self.run.event("balance_problem", step=step, detail=f"{type(e).__name__}: {e}")

    def commit(self, out: StepOutcome) -> ReplanOrder | None:
        """Record a step that completed on every rank: its record, pace and balancing, metrics,
        snapshot and durable checkpoint; and its replicas' check (``Corruption.observe``), whose
        mismatch's replay comes back."""
        run, cfg, step, pool = self.run, self.cfg, out.step, self.pool
        self.anomalies.committed(out)
        record = self.driver.record(out, run.plan.topology, len(run.plans) - 1)
        where = {r: (w, pool[w].node if w in pool else None) for r, w in run.ranks.items()}
        named = False
        for ev in self.balance.observe(step, out.results, record, where, out.shares):
            named = named or ev["kind"] == "straggler"
            run.event(ev.pop("kind"), **ev)
        for key, field in (("peak_rss_bytes", "rank_peak_rss_bytes"), ("peak_device_bytes", "rank_peak_device_bytes")):
            peaks = {str(o["rank"]): o[key] for o in out.results.values() if o.get(key)}
            if peaks:
                record[field] = dict(sorted(peaks.items(), key=lambda kv: int(kv[0])))
        moves = Moves()
        try:
            moves = self.balance.act(step, named)
            for ev in list(moves) + self.bench.poll(step):
                run.event(ev.pop("kind"), **ev)
        except Exception as e:  # noqa: BLE001 - working around a straggler must never end the run
            self._balance_failed(step, e)
        finally:
            # Balance counts on its decision being taken (it waits for the re-plan): taken even
            # where recording the events around it failed.
            self._carry_out(moves, step)
        # What driving the run has cost so far, in actor calls (this step's snapshot pins, issued
        # below, count in the next record).
        record["actor_calls"] = self.driver.calls + self.snapshots.calls
        # The controller process's CPU seconds so far (Ray's threads sending and taking its calls
        # included): what driving costs where its wall time also waits for a core.
        record["controller_cpu_s"] = time.process_time()
        record["heartbeats"] = self.driver.heartbeats
        run.commit_step(record, split_rank_figures(record))
        self._charge_step(record)
        run.goodput.move("training", "integrity", min(record.get("step_time_s") or 0.0, record.get("check_s") or 0.0))
        replay = self.corruption.observe(out)
        run.metrics.record_goodput(run.goodput.report())
        self.recovery.step_committed()
        self.replanner.step_committed()
        self._memory_kills()
        choice = self.schedule.observe(step, record["step_time_s"], snapshot=bool(out.snapshot))
        if choice:
            run.event("snapshot_interval", **choice)
        ps = self._ps()
        if out.snapshot:
            self.schedule.taken(step)
            self.snapshots.take_step(step, {r: pool[w] for r, w in run.ranks.items()}, out.shard_refs,
                                     nbytes=sum(o.get("snapshot_bytes", 0) for o in out.results.values()),
                                     results=out.results)
            run.points.reach("snapshot_in_flight", step=step)
            if ps:
                ps.snapshot(step)
        for snap in self.snapshots.poll():
            # Not a result event (one per step would drown the others): a metric only.
            run.metrics.record_event({"kind": "snapshot", "step": snap.step, "bytes": snap.nbytes,
                                      "seconds": snap.committed_at - snap.started})
        for snap in self.snapshots.take_dropped():
            run.event("snapshot_dropped", step=snap.step, reason=snap.dropped)
        self.snapshots.prune()
        if ps:
            ps.retain(self.snapshots.steps())
        if self.writer and cfg.checkpoint.durable_every and step % cfg.checkpoint.durable_every == 0 \
                and step < cfg.train.steps and self.corruption.durable_ok(step):
            # On the step path only where no step runs meanwhile (else the workers run on).
            with run.goodput.phase("checkpointing", only_from="controller"):
                self.writer.start(step, list(run.history), run.plan.describe())
        return replay

    def _charge_step(self, record: dict) -> None:
        """Of a step's time, what was not training (``goodput``): its update's wait for a snapshot
        copy, and a named straggler's share (the step at the straggler's pace over the step at
        its peers', on the compute it slowed)."""
        clock, dt = self.run.goodput, record.get("step_time_s") or 0.0
        clock.move("training", "checkpointing", min(dt, record.get("snapshot_wait_s") or 0.0))
        slow = self.balance.tracker.stragglers
        paces = [p for r, p in (record.get("pace") or {}).items() if int(r) in slow]
        if paces and max(paces) > 1.0:
            compute = record.get("worker_s") or dt
            clock.move("training", "stragglers", compute * (1.0 - 1.0 / max(paces)))
