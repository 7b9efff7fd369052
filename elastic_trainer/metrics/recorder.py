"""``RunMetrics``: records a run's step records and events as ``ray.util.metrics``.

Built from ``names.METRICS``: each history key or event field that feeds a
metric is named there, not here. The Ray metric objects are created on first
use, inside whichever process records (the controller actor), because they
bind to that process's core worker; before Ray is initialized, or in a
process that never imported Ray, every method does nothing.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from typing import Any, Callable

from .names import COUNTER, GAUGE, HISTOGRAM, METRICS, RECOVERY_PHASES, STATES, MetricSpec, metric

log = logging.getLogger(__name__)
_REFRESH_S = 5.0

_STATE = metric("controller_state").name
_FAILURES = metric("failures").name
_RECOVERY = metric("recovery_seconds").name
_LAST_RECOVERY = metric("last_recovery_seconds").name
# Event kind -> (metric, event field) for the gauges set straight from an event.
_EVENT_GAUGES: dict[str, tuple[tuple[str, str], ...]] = {
    "snapshot": ((metric("snapshot_seconds").name, "seconds"), (metric("snapshot_bytes").name, "bytes")),
    "snapshot_interval": ((metric("snapshot_interval_steps").name, "interval"),
                          (metric("snapshot_redo_steps").name, "redo_steps"),
                          (metric("snapshot_cost_seconds").name, "snapshot_cost_s")),
    "durable_checkpoint": ((metric("durable_checkpoint_seconds").name, "seconds"),
                           (metric("durable_checkpoint_bytes").name, "bytes"),
                           (metric("durable_checkpoint_step").name, "step")),
}
_STEP_GAUGES = tuple(m for m in METRICS if m.source == "step")
_RANK_GAUGES = tuple(m for m in METRICS if m.source == "step_per_rank")
_STRAGGLERS = metric("stragglers").name
_REBALANCES = metric("rebalances").name
_DURABLE_FAILURES = metric("durable_failures").name
_GOODPUT = metric("goodput_ratio").name
_DRAINS = metric("drains").name
_ANOMALIES = metric("anomalies").name
_CORRUPTIONS = metric("corruptions").name
_GOODPUT_SECONDS = metric("goodput_seconds").name


def ray_metric(spec: MetricSpec):
    """A ``ray.util.metrics`` object for ``spec`` (call inside a process connected to Ray)."""
    from ray.util import metrics as ray_metrics

    if spec.kind == GAUGE:
        return ray_metrics.Gauge(spec.name, description=spec.description, tag_keys=spec.tag_keys)
    if spec.kind == COUNTER:
        return _Counter(ray_metrics.Counter(spec.name, description=spec.description, tag_keys=spec.tag_keys))
    if spec.kind == HISTOGRAM:
        return ray_metrics.Histogram(spec.name, description=spec.description, boundaries=list(spec.boundaries),
                                     tag_keys=spec.tag_keys)
    raise ValueError(f"unknown metric kind {spec.kind!r}")


class _Counter:
    """A ``ray.util.metrics.Counter`` whose ``inc(0)`` records 0, which Ray's refuses: a series is
    exported only once something is recorded under its tags, so 0 is how it exists from the start."""

    def __init__(self, counter):
        self.counter = counter

    def inc(self, value: float, tags: dict) -> None:
        if value == 0:
            self.counter._record(0.0, tags=tags)   # adds nothing to the sum; creates the series
        else:
            self.counter.inc(value, tags=tags)


def _ray_connected() -> bool:
    # Looking in sys.modules keeps a process that never used Ray from importing it here.
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _number(value: Any) -> float | None:
    # Ray rejects anything but int and float (numpy integers included), so convert here.
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class RunMetrics:
    """Exports one run's metrics, every series tagged ``run=<run name>``.

    ``factory`` makes the metric object for a spec; the default makes
    ``ray.util.metrics`` objects once Ray is initialized in this process.
    Tests pass a factory of fakes. When the metrics are made, every counter series the run can
    count under (``MetricSpec.zero_series``) is exported at 0. Recording never raises: a metric that
    cannot be recorded is logged once and skipped, so metrics cannot stop a run.
    Safe to call from several threads (durable checkpoints finish on their own).
    """

    def __init__(self, run: str, factory: Callable[[MetricSpec], Any] | None = None):
        self.run = run
        self._factory = factory
        self._metrics: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._states = list(STATES)
        self._recoveries_seen: set = set()
        self._warned: set[str] = set()
        # Last value of every gauge series: Ray's exporter drops a gauge not set for ~20 s
        # (measured, Ray 2.60), and a stuck run must keep showing its last step.
        self._last: dict[tuple, float] = {}
        self._refresher: threading.Thread | None = None

    def __getstate__(self):
        # Ray metric objects belong to the process that made them: a copy makes its own.
        state = self.__dict__.copy()
        state.update(_metrics=None, _lock=None, _refresher=None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether recording reaches a backend (Ray connected, or a factory was given)."""
        return self._get() is not None

    def record_step(self, record: dict) -> None:
        """Set the per-step gauges from one history record (keys absent or None are skipped)."""
        metrics = self._get()
        if metrics is None:
            return
        for spec in _STEP_GAUGES:
            value = _number(record.get(spec.field))
            if value is not None:
                self._call(spec.name, "set", value, {})
        for spec in _RANK_GAUGES:
            for rank, v in (record.get(spec.field) or {}).items():
                value = _number(v)
                if value is not None:
                    self._call(spec.name, "set", value, {"rank": str(rank)})

    def record_goodput(self, report: dict) -> None:
        """Set the goodput gauges from the run's clock (``GoodputClock.report``)."""
        metrics = self._get()
        if metrics is None:
            return
        value = _number(report.get("goodput"))
        if value is not None:
            self._call(_GOODPUT, "set", value, {})
        for bucket, seconds in (report.get("seconds") or {}).items():
            self._call(_GOODPUT_SECONDS, "set", float(seconds), {"bucket": bucket})

    def set_state(self, state: Any) -> None:
        """Mark ``state`` (a ``RunState`` or its name) as the controller's state: 1 for it, 0 for the rest."""
        metrics = self._get()
        if metrics is None:
            return
        name = str(getattr(state, "value", state))
        with self._lock:
            if name not in self._states:
                self._states.append(name)
            states = list(self._states)
        for s in states:
            self._call(_STATE, "set", 1.0 if s == name else 0.0, {"state": s})

    def record_event(self, event: dict) -> None:
        """Record one controller event; kinds no metric uses are ignored.

        ``state`` sets the state gauges; ``failure`` counts one failure of its
        ``failure`` kind; ``durable_failed`` counts one failed durable checkpoint of its
        ``role``; ``recovery`` sets the last recovery's phase times
        and, once ``total_s`` is known (after the first step that follows),
        observes it once; ``snapshot`` and ``durable_checkpoint`` set their
        seconds/bytes (and step) gauges; ``snapshot_interval``
        sets the chosen interval, the steps a failure would redo and the cost measured.
        """
        metrics = self._get()
        if metrics is None:
            return
        kind = event.get("kind")
        if kind == "state":
            if event.get("to") is not None:
                self.set_state(event["to"])
        elif kind == "failure":
            self._call(_FAILURES, "inc", 1.0, {"kind": str(event.get("failure") or "unknown")})
        elif kind == "recovery":
            self._record_recovery(event)
        elif kind == "straggler":
            self._call(_STRAGGLERS, "inc", 1.0, {})
        elif kind == "rebalance":
            self._call(_REBALANCES, "inc", 1.0, {"action": str(event.get("action") or "unknown")})
        elif kind == "corruption" and event.get("suspects"):
            self._call(_CORRUPTIONS, "inc", 1.0, {})
        elif kind == "anomaly":
            self._call(_ANOMALIES, "inc", 1.0, {"kind": str(event.get("anomaly") or "unknown")})
        elif kind == "drain" and event.get("outcome"):
            self._call(_DRAINS, "inc", 1.0, {"outcome": str(event["outcome"])})
        elif kind == "durable_failed":
            self._call(_DURABLE_FAILURES, "inc", 1.0, {"role": str(event.get("role") or "unknown")})
        elif kind in _EVENT_GAUGES:
            for name, field in _EVENT_GAUGES[kind]:
                value = _number(event.get(field))
                if value is not None:
                    self._call(name, "set", value, {})

    def _record_recovery(self, event: dict) -> None:
        for phase in RECOVERY_PHASES:
            value = _number(event.get(f"{phase}_s"))
            if value is not None:
                self._call(_LAST_RECOVERY, "set", value, {"phase": phase})
        total = _number(event.get("total_s"))
        if total is None or not math.isfinite(total) or total < 0:
            return
        # The controller fills in total_s on the event it already reported; the
        # controller may pass it here twice, but it is one recovery.
        key = (event.get("time"), event.get("failed_step"), event.get("restored_step"))
        with self._lock:
            if key in self._recoveries_seen:
                return
            self._recoveries_seen.add(key)
        self._call(_RECOVERY, "observe", total, {"reason": str(event.get("reason") or "unknown")})

    def _get(self) -> dict[str, Any] | None:
        if self._metrics is not None:
            return self._metrics
        factory = self._factory
        if factory is None:
            if not _ray_connected():
                return None
            factory = ray_metric
        with self._lock:
            if self._metrics is None:
                made = {}
                for spec in METRICS:
                    try:
                        made[spec.name] = factory(spec)
                    except Exception as e:
                        log.warning("[%s] metric %s not created: %s: %s", self.run, spec.name, type(e).__name__, e)
                self._metrics = made
                # Every counter series at 0 before its first event: increase() over a series that
                # appears with its first count (1) sees no increase, and the alerts' offset no base.
                for spec in METRICS:
                    for tags in spec.zero_series():
                        self._call(spec.name, "inc", 0.0, tags)
                if self._factory is None:
                    self._refresher = threading.Thread(target=self._refresh_loop, name="metrics-refresh",
                                                       daemon=True)
                    self._refresher.start()
        return self._metrics

    def refresh(self) -> None:
        """Set every gauge series again to its last value."""
        with self._lock:
            last = list(self._last.items())
        for (name, tags), value in last:
            self._call(name, "set", value, dict(tags))

    def _refresh_loop(self) -> None:
        while True:
            time.sleep(_REFRESH_S)
            self.refresh()

    def _call(self, name: str, method: str, value: float, tags: dict) -> None:
        if method == "set":
            with self._lock:
                self._last[(name, tuple(sorted(tags.items())))] = value
        try:
            getattr(self._metrics[name], method)(value, tags={"run": self.run, **tags})
        except Exception as e:
            if name not in self._warned:
                self._warned.add(name)
                log.warning("[%s] metric %s not recorded: %s: %s", self.run, name, type(e).__name__, e)
