"""Every metric the trainer exports, as data.

Dashboards and alert rules are generated from ``METRICS`` (see
``metrics.dashboards``), so a panel can only show a series that something
records. Nothing here imports Ray: the torch-only parts and the dashboard
generator read these names without a cluster.

Names as Prometheus sees them (Ray 2.60, OpenTelemetry export, the default):
Ray's metrics agent registers every ``ray.util.metrics`` metric as
``ray_<name>``; a Counter is exported as a Prometheus counter, which the
Prometheus client names ``<family>_total``; a Histogram is exported as
``<family>_bucket`` / ``_sum`` / ``_count``. The unit Ray passes ("1") maps to
no suffix (tests/integration/test_metrics_export.py scrapes a real node to
keep ``prometheus_names()`` honest). Ray adds its own labels to every series
(``Component``, ``NodeAddress``, ``SessionName``, ``Version``, ``WorkerId``,
``otel_scope_*``), so queries aggregate ``by (run, ...)`` to drop them.
Gauges stay exported at their last value while the recording process lives,
and vanish a few seconds after it exits.

``elastic_trainer_controller_state`` is one gauge per state (tag ``state``):
1 for the state the controller is in, 0 for every other state. A numeric
code would need a legend to read and cannot be summed across runs; one
series per state can (``sum(...{state="RECOVERING"})`` counts recovering runs).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "elastic_trainer_"
# Ray's agent prepends this to every application metric it exports.
RAY_PREFIX = "ray_"

GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

# Mirrors controller.RunState (a test keeps them equal): metrics sits below the
# controller in the import order, so it cannot import the enum.
STATES = ("PENDING", "PLACING", "STARTING", "RUNNING", "RECOVERING", "RESIZING", "FINISHED", "STOPPED", "FAILED")

# Phases of one recovery, as the controller's "recovery" event times them.
RECOVERY_PHASES = ("detect", "replan", "restore", "first_step", "total")

# Every value the controller gives a counter's own tag, so the recorder can export each series at
# 0 before its first event (increase() and `offset` miss the event that creates a series).
# controller/failures/recovery.py emits the failure kinds, controller/balance/stragglers.py and benching.py the
# rebalance actions; tests/unit/test_metrics.py reads those sources to keep the lists whole.
FAILURE_KINDS = ("startup", "death", "silent", "hang", "exception", "collective", "during_recovery")
REBALANCE_ACTIONS = ("shares", "equal shares", "balanced cut", "recut", "spare", "readmit")
# controller/state/durable_writer.py's roles of a durable checkpoint.
DURABLE_ROLES = ("periodic", "final", "emergency")
# controller/replanning/drains.py's outcomes of a preemption notice.
DRAIN_OUTCOMES = ("moved", "loss", "idle")
# integrity/anomaly.py's anomalies, and controller/integrity's actions on them.
ANOMALY_KINDS = ("nonfinite", "spike", "corruption")

# Dashboard rows, in display order.
GROUPS = ("progress", "goodput", "throughput", "communication", "elasticity", "checkpoints")


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric.

    ``source`` says what feeds it: ``"step"`` (a key of a history record,
    named by ``field``), ``"step_per_rank"`` (a history key holding one value per rank, tagged
    ``rank``), an event kind (``"straggler"``, ``"rebalance"``, ``"failure"``, ``"recovery"``,
    ``"snapshot"``, ``"snapshot_interval"``, ``"durable_checkpoint"``), or ``"state"``.

    ``tag_values``: for a counter, ``(tag, values)`` for each tag after ``run``: every value the
    controller counts under, so each series is exported at 0 from the start.
    """

    name: str
    kind: str
    description: str
    unit: str
    group: str
    source: str
    field: str | None = None
    tag_keys: tuple[str, ...] = ("run",)
    boundaries: tuple[float, ...] = ()
    tag_values: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __post_init__(self):
        if not self.name.startswith(PREFIX):
            raise ValueError(f"metric {self.name!r} must start with {PREFIX!r}")
        if self.kind not in (GAUGE, COUNTER, HISTOGRAM):
            raise ValueError(f"metric {self.name!r}: kind {self.kind!r} is not one of gauge, counter, histogram")
        if (self.kind == HISTOGRAM) != bool(self.boundaries):
            raise ValueError(f"metric {self.name!r}: boundaries are required for histograms and only for them")
        if self.tag_keys[:1] != ("run",):
            raise ValueError(f"metric {self.name!r}: the first tag must be 'run', got {self.tag_keys}")
        if self.group not in GROUPS:
            raise ValueError(f"metric {self.name!r}: group {self.group!r} is not one of {GROUPS}")
        if self.kind == COUNTER and self.name.endswith("_total"):
            # Ray's legacy (OpenCensus) exporter would then name it ..._total_total.
            raise ValueError(f"counter {self.name!r}: leave '_total' off; the exporter adds it")
        if self.kind == COUNTER and tuple(t for t, _ in self.tag_values) != self.tag_keys[1:]:
            raise ValueError(f"counter {self.name!r}: tag_values must list the values of every tag after 'run' "
                             f"({self.tag_keys[1:]}), got {tuple(t for t, _ in self.tag_values)}")
        if self.kind != COUNTER and self.tag_values:
            raise ValueError(f"metric {self.name!r}: tag_values are for counters only")

    def zero_series(self) -> list[dict[str, str]]:
        """A counter's tags (less ``run``) of every series it will count under, to export at 0."""
        series: list[dict[str, str]] = [{}]
        for tag, values in self.tag_values:
            series = [{**s, tag: v} for s in series for v in values]
        return series if self.kind == COUNTER else []

    @property
    def prometheus_name(self) -> str:
        """The metric family name Prometheus sees (without histogram suffixes)."""
        return RAY_PREFIX + self.name + ("_total" if self.kind == COUNTER else "")

    @property
    def series(self) -> tuple[str, ...]:
        """Every series name this metric produces in Prometheus."""
        if self.kind == HISTOGRAM:
            return tuple(self.prometheus_name + s for s in ("_bucket", "_sum", "_count"))
        return (self.prometheus_name,)


def _step(name, description, unit, group, field=None):
    return MetricSpec(PREFIX + name, GAUGE, description, unit, group, "step", field or name)


METRICS: tuple[MetricSpec, ...] = (
    # progress
    _step("step", "Last step every rank finished; drops when a recovery rolls back.", "steps", "progress"),
    _step("loss", "Training loss of the last step, averaged over the ranks that compute it.", "loss", "progress"),
    _step("eval_loss", "Validation loss of the last evaluation (eval.every), on the held-out windows.", "loss",
          "progress"),
    _step("lr", "Learning rate of the last step's update (train.lr_schedule).", "rate", "progress"),
    _step("grad_norm", "Global gradient norm of the last step (before clipping), agreed over every rank.", "norm",
          "progress"),
    MetricSpec(PREFIX + "anomalies", COUNTER,
               "Steps judged anomalous (integrity: a non-finite or spiking loss or gradient norm), applied nowhere, "
               "by kind.", "steps", "progress", "anomaly", tag_keys=("run", "kind"),
               tag_values=(("kind", ANOMALY_KINDS),)),
    MetricSpec(PREFIX + "corruptions", COUNTER,
               "Silent data corruption proven (a replica's state disagreed, a replay or its checksum named the "
               "rank); each quarantines the rank's node.", "proofs", "progress", "corruption"),
    MetricSpec(PREFIX + "controller_state", GAUGE,
               "1 for the state the run's controller is in, 0 for the others.", "bool", "progress", "state",
               tag_keys=("run", "state")),
    # goodput (controller.run.goodput): set after every step from the run's clock
    MetricSpec(PREFIX + "goodput_ratio", GAUGE,
               "Wall time of the steps that count (each once) over the run's wall time so far.", "ratio",
               "goodput", "goodput"),
    MetricSpec(PREFIX + "goodput_seconds", GAUGE,
               "The run's wall time so far by where it went: training, startup, waiting_for_nodes, detection, "
               "replan, restore, redone, checkpointing, drains, resizing, stragglers, evaluation, integrity, controller.",
               "s", "goodput", "goodput", tag_keys=("run", "bucket")),
    # throughput
    _step("tokens_per_s", "Tokens of the global batch divided by the last step's wall time.", "tokens/s",
          "throughput"),
    _step("step_time_s", "Wall time of the last step as the controller saw it.", "s", "throughput"),
    MetricSpec(PREFIX + "rank_pace", GAUGE,
               "Each rank's compute over its peers' (median over balance.window steps; 1 = even).", "ratio",
               "throughput", "step_per_rank", field="pace", tag_keys=("run", "rank")),
    MetricSpec(PREFIX + "rank_peak_rss_bytes", GAUGE,
               "Each rank's peak resident memory in the last step (the kernel's VmHWM, reset every step).", "bytes",
               "throughput", "step_per_rank", field="rank_peak_rss_bytes", tag_keys=("run", "rank")),
    MetricSpec(PREFIX + "rank_peak_device_bytes", GAUGE,
               "Each GPU rank's peak device memory in the last step (torch.cuda.max_memory_allocated, reset "
               "every step).", "bytes", "throughput", "step_per_rank", field="rank_peak_device_bytes",
               tag_keys=("run", "rank")),
    MetricSpec(PREFIX + "stragglers", COUNTER,
               "Ranks that turned slow: pace past 1 + balance.threshold over balance.window steps.", "ranks",
               "throughput", "straggler"),
    MetricSpec(PREFIX + "rebalances", COUNTER,
               "Balancing moves (balance.mode act), by action: shares, equal shares, spare, readmit.", "moves",
               "throughput", "rebalance", tag_keys=("run", "action"), tag_values=(("action", REBALANCE_ACTIONS),)),
    # communication
    _step("comm_bytes", "Gradient bytes all ranks sent in the last step.", "bytes", "communication"),
    _step("comm_time_s", "Time the slowest rank spent in collectives in the last step.", "s", "communication",
          field="comm_time_s"),
    _step("exposed_comm_s", "Communication time of the last step not hidden behind compute.", "s",
          "communication"),
    _step("compression_ratio", "Uncompressed over sent gradient bytes in the last step (1 = no compression).",
          "ratio", "communication"),
    # elasticity
    _step("world_size", "Ranks in the current plan.", "workers", "elasticity"),
    _step("dp", "Data-parallel replicas in the current plan.", "workers", "elasticity"),
    _step("pp", "Pipeline stages in the current plan.", "workers", "elasticity"),
    MetricSpec(PREFIX + "failures", COUNTER, "Worker failures seen by the controller, by kind.", "failures",
               "elasticity", "failure", tag_keys=("run", "kind"), tag_values=(("kind", FAILURE_KINDS),)),
    MetricSpec(PREFIX + "drains", COUNTER,
               "Preemption notices (Ray drains) by outcome: ranks moved off in time, left to the loss path "
               "(too short to move), or idle (no rank there).", "drains", "elasticity", "drain",
               tag_keys=("run", "outcome"), tag_values=(("outcome", DRAIN_OUTCOMES),)),
    MetricSpec(PREFIX + "recovery_seconds", HISTOGRAM,
               "Time from failure (or resize) to the first step committed after it.", "s", "elasticity",
               "recovery", tag_keys=("run", "reason"),
               boundaries=(0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)),
    # Exact seconds of the last recovery per phase: the histogram's _sum is rebuilt
    # from bucket midpoints by Ray's OpenTelemetry exporter, so it is approximate.
    MetricSpec(PREFIX + "last_recovery_seconds", GAUGE, "Seconds each phase of the last recovery took.", "s",
               "elasticity", "recovery", tag_keys=("run", "phase")),
    # checkpoints
    MetricSpec(PREFIX + "snapshot_seconds", GAUGE,
               "Seconds from taking the last object-store snapshot to all its copies being pinned.", "s",
               "checkpoints", "snapshot"),
    MetricSpec(PREFIX + "snapshot_bytes", GAUGE, "Bytes of the last object-store snapshot (one copy).", "bytes",
               "checkpoints", "snapshot"),
    MetricSpec(PREFIX + "snapshot_interval_steps", GAUGE,
               "Steps between snapshots, as checkpoint.memory_every 'auto' last chose it.", "steps",
               "checkpoints", "snapshot_interval"),
    MetricSpec(PREFIX + "snapshot_redo_steps", GAUGE,
               "Steps a failure would run again at the chosen snapshot interval, at most.", "steps",
               "checkpoints", "snapshot_interval"),
    MetricSpec(PREFIX + "snapshot_cost_seconds", GAUGE,
               "What one snapshot adds to step time, as measured for the snapshot interval.", "s",
               "checkpoints", "snapshot_interval"),
    MetricSpec(PREFIX + "durable_checkpoint_seconds", GAUGE, "Seconds the last durable checkpoint took to write.",
               "s", "checkpoints", "durable_checkpoint"),
    MetricSpec(PREFIX + "durable_checkpoint_bytes", GAUGE, "Bytes of the last durable checkpoint.", "bytes",
               "checkpoints", "durable_checkpoint"),
    MetricSpec(PREFIX + "durable_checkpoint_step", GAUGE, "Step of the last durable checkpoint.", "steps",
               "checkpoints", "durable_checkpoint"),
    MetricSpec(PREFIX + "durable_failures", COUNTER,
               "Durable checkpoints that failed to write, by role: a periodic one the run goes on after, "
               "the final or emergency one.", "checkpoints", "checkpoints", "durable_failed",
               tag_keys=("run", "role"), tag_values=(("role", DURABLE_ROLES),)),
)

_BY_NAME = {m.name: m for m in METRICS}
if len(_BY_NAME) != len(METRICS):
    raise ValueError("two metrics share a name")


def metric(name: str) -> MetricSpec:
    """The spec named ``name``, with or without the ``elastic_trainer_`` prefix."""
    full = name if name.startswith(PREFIX) else PREFIX + name
    try:
        return _BY_NAME[full]
    except KeyError:
        raise KeyError(f"no metric {full!r}; known: {sorted(_BY_NAME)}") from None


def prometheus_names() -> list[str]:
    """Every series name the trainer's metrics produce in Prometheus, sorted.

    Histograms contribute ``_bucket``, ``_sum`` and ``_count``; counters end in ``_total``.
    """
    return sorted(s for m in METRICS for s in m.series)
