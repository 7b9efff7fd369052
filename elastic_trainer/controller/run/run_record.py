"""The run's state, in one place: the one object that writes it.

What every part of the controller reads (the step, the plan and which worker
holds each rank, the history, the events, the run's id, a stop asked for) is
here, and only the operations below change it: ``transition``, ``event``,
``commit_step``, ``record_eval``, ``apply_plan``, ``adopt``, ``add_skip``, ``skip_since``,
``request_stop``.
Each takes the lock the read-only queries take (``queries``), so a caller on
another thread of the actor never sees half of a change. The parts that decide
(recovery, balancing, the step loop) hold this object, never the controller.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from ...config import TrainerConfig
from ...data.skips import add_range, cursor
from ...metrics import RunMetrics
from ...planning.plan import Plan
from ...secrets import mask
from .fault_points import NO_POINTS
from .goodput import GoodputClock
from .rank_figures import RankFigures
from .run_state import RunState, RunStateMachine

log = logging.getLogger(__name__)


def _masked(detail: dict) -> dict:
    """An event's detail with its texts masked (an error quoting a URI, a library's message):
    events reach the driver, the report, the metrics and ``status``. Only the top level: a
    nested value may be completed later by reference."""
    return {k: mask(v) if isinstance(v, str) else v for k, v in detail.items()}


class RunRecord:
    """The run's state: step, plan, ranks, history, events, identity, stop request."""

    def __init__(self, cfg: TrainerConfig, name: str, metrics: RunMetrics | None = None):
        self.cfg = cfg
        self.name = name
        self.run_id = uuid.uuid4().hex[:12]   # its durable checkpoints carry it; a resume adopts the stored one
        self.machine = RunStateMachine()
        self.metrics = metrics if metrics is not None else RunMetrics(name)
        self.events: list[dict] = []
        self._held: list[dict] = []           # events to be completed before they are shown (hold_event)
        self.history: list[dict] = []
        self.rank_figures = RankFigures()     # each step's per-rank figures, kept out of its record
        self.plans: list[dict] = []
        self.plan: Plan | None = None
        self.ranks: dict[int, int] = {}       # rank -> worker id
        self.step = 0                         # last step every rank finished
        self.rolled_back = 0                  # steps after the restored one, to be run again
        self.counts: list[int] = []           # parameters per block
        self.setting_up: dict | None = None   # the plan being set up now: dp, pp, rank -> worker id
        # (set-up generation, step it restored) of every set-up: a copy made before a set-up, of a
        # step after the one it restored, is of an abandoned timeline (worker.copies.on_timeline).
        self.timeline: list[tuple[int, int]] = []
        self.generation = 0                   # numbers set-up attempts, so a stale one can be aborted
        self.points = NO_POINTS               # where a fault campaign may hold the run (fault_points)
        self.error_at: int | None = None      # inject_fault("controller_error"): the step to raise before
        self.goodput = GoodputClock()         # where the wall time goes (restarted when the run starts)
        # The sample ranges the run never reads: the config's, and the batches it left out after
        # anomalies (integrity); the workers take them at each set-up (data.skips).
        self.data_skips: list[tuple[int, int]] = [tuple(r) for r in cfg.data.skip_samples]
        self.halt: str | None = None          # why the run, once its last good step is saved, ends FAILED
        self.lock = threading.Lock()
        self._stop = threading.Event()

    # -- reads ---------------------------------------------------------------------------------
    @property
    def state(self) -> RunState:
        return self.machine.state

    @property
    def stopping(self) -> bool:
        """Whether a stop was asked: the loop ends after the steps in flight."""
        return self._stop.is_set()

    def error_due(self, step: int) -> bool:
        """Whether an injected controller error is armed for ``step`` (0: the next one)."""
        return self.error_at is not None and self.error_at in (step, 0)

    def failure_summary(self) -> str:
        return "; ".join(f"{e['failure']} of worker {e['worker']} at step {e['step']}"
                         + (f" ({e['detail'][:160]})" if e.get("detail") else "")
                         for e in self.events if e["kind"] == "failure") or "no failures"

    # -- changes -------------------------------------------------------------------------------
    def transition(self, new: RunState, **detail) -> tuple[RunState, RunState]:
        detail = _masked(detail)
        with self.lock:
            prev, _ = self.machine.move(new)
            self.events.append({"kind": "state", "from": prev.value, "to": new.value, "time": time.time(), **detail})
        self.metrics.set_state(new)
        log.info("[%s] %s -> %s%s", self.name, prev.value, new.value, "".join(f" {k}={v}" for k, v in detail.items()))
        return prev, new

    def event(self, kind: str, **detail) -> dict:
        """Record an event (and its metrics); the event itself, which a recovery completes later."""
        ev = {"kind": kind, "time": time.time(), **_masked(detail)}
        with self.lock:
            self.events.append(ev)
        self.metrics.record_event(ev)
        return ev

    def hold_event(self, kind: str, **detail) -> dict:
        """An event not yet shown: one that is completed later (a recovery, by its first step),
        published whole by ``publish``. A driver reads events once each, so one shown and then
        completed would stay unfinished there."""
        ev = {"kind": kind, "time": time.time(), **_masked(detail)}
        with self.lock:
            self._held.append(ev)
        return ev

    def publish(self, ev: dict, **more) -> dict:
        """Show the held event ``ev``, with ``more`` added (and its metrics recorded)."""
        with self.lock:
            ev.update(more)
            self._held = [e for e in self._held if e is not ev]
            self.events.append(ev)
        self.metrics.record_event(ev)
        return ev

    def name_cause(self, failure: int, cause: str) -> None:
        """The recovery from the run's ``failure``-th failure learns its cause, found after its
        event was recorded (a memory kill, asked of the dead worker's node)."""
        with self.lock:
            for ev in self.events + self._held:
                if ev["kind"] == "recovery" and ev.get("failure") == failure:
                    ev["cause"] = cause

    def commit_step(self, record: dict, figures: dict) -> None:
        """A step completed on every rank: its record, and its per-rank figures apart."""
        with self.lock:
            self.history.append(record)
            self.rank_figures.append(figures)
            self.step = record["step"]
        self.metrics.record_step({**record, **figures})

    def record_eval(self, step: int, loss: float, seconds: float) -> None:
        """An evaluation after ``step``: its loss on that step's record, the metrics, an event."""
        with self.lock:
            for rec in reversed(self.history):
                if rec["step"] == step:
                    rec["eval_loss"] = loss
                    rec["eval_s"] = seconds
                    break
        self.metrics.record_step({"eval_loss": loss})
        topo = self.plan.topology
        self.event("eval", step=step, loss=loss, seconds=seconds, dp=topo.dp, pp=topo.pp)

    def setup_started(self, plan: Plan, ranks: dict[int, int]) -> None:
        with self.lock:
            self.setting_up = {"dp": plan.topology.dp, "pp": plan.topology.pp, "workers": dict(ranks)}

    def setup_ended(self) -> None:
        with self.lock:
            self.setting_up = None

    def timeline_to(self, step: int) -> list[tuple[int, int]]:
        """The timeline as it stands once the next set-up restores ``step`` or an earlier one: every
        step after ``step`` made so far is then of an abandoned timeline."""
        with self.lock:
            return self.timeline + [(self.generation + 1, step)]

    def begin_setup(self, restored: int) -> tuple[int, list[tuple[int, int]]]:
        """A set-up attempt that restores step ``restored``: its generation, and the timeline with it."""
        with self.lock:
            self.generation += 1
            self.timeline.append((self.generation, restored))
            return self.generation, list(self.timeline)

    def apply_plan(self, plan: Plan, ranks: dict[int, int], restored: int, restoring: bool) -> dict:
        """``plan`` is set up on ``ranks`` at step ``restored``: the steps after it (with
        ``restoring``) are rolled back, to be run again. Returns the plan's description."""
        desc = plan.describe()
        desc["workers"] = dict(ranks)
        desc["from_step"] = restored + 1
        with self.lock:
            self.ranks = dict(ranks)
            self.plan = plan
            self.rolled_back = self.step - restored if restoring else 0
            lost = [h for h in self.history if h["step"] > restored]
            self.history = [h for h in self.history if h["step"] <= restored]
            self.step = restored
            self.plans.append(desc)
        # Their first runs are lost: the steps count once, when they are run again.
        self.goodput.move("training", "redone", sum(h.get("step_time_s") or 0.0 for h in lost))
        return desc

    def add_skip(self, start: int, end: int) -> None:
        """Samples ``[start, end)`` are never read (merged with the ranges so far)."""
        with self.lock:
            self.data_skips = add_range(self.data_skips, int(start), int(end))

    def skip_since(self, restored: int, failed_cursor: int) -> list[int]:
        """A rollback to step ``restored`` from a step whose batch began at ``failed_cursor``: the
        batches from the step after ``restored`` to that one's left out; the range."""
        gb = self.cfg.train.global_batch_size
        with self.lock:
            start = cursor(restored + 1, gb, self.data_skips)
            self.data_skips = add_range(self.data_skips, start, failed_cursor + gb)
        return [start, failed_cursor + gb]

    def adopt(self, run_id: str | None, history: list[dict], data_skips=None) -> None:
        """A resume: continue as the run ``run_id`` (None: keep this run's id, a branch), with the
        history its checkpoint carried."""
        with self.lock:
            if run_id:
                self.run_id = run_id
            self.history.extend(history)
            for start, end in data_skips or ():
                self.data_skips = add_range(self.data_skips, int(start), int(end))

    def request_stop(self, reason: str = "") -> bool:
        """Ask the run to end after the steps in flight; False if asked already or it has ended."""
        with self.lock:
            if self._stop.is_set() or self.machine.ended:
                return False
            self._stop.set()
            step = self.step
        self.event("stop_requested", step=step, reason=str(reason)[:300])
        log.warning("[%s] stop requested at step %d%s: the run ends after the steps in flight", self.name, step,
                    f" ({reason})" if reason else "")
        return True
