"""The Grafana dashboard and the Prometheus alert rules, generated from ``names.METRICS``.

``scripts/gen_dashboards.py`` writes ``render()``'s files into ``dashboards/``;
its ``--check`` compares them with what is on disk. Output is a pure function
of ``METRICS`` (no times, no ids from counters that persist), so rerunning it
gives the same bytes.
"""

from __future__ import annotations

import json

import yaml

from .names import COUNTER, GAUGE, GROUPS, HISTOGRAM, METRICS, MetricSpec, metric

DASHBOARD_FILE = "elastic_trainer.json"
ALERTS_FILE = "alerts.yml"

# Alert thresholds. A step of a large model can take minutes; ten without one
# while the controller says RUNNING is a hang, not a slow step.
STALL_MINUTES = 10
FAILURE_WINDOW_MINUTES = 15
FAILURE_THRESHOLD = 3
RECOVERY_STUCK_MINUTES = 10

_DS = {"type": "prometheus", "uid": "${datasource}"}
_RUN = 'run=~"$run"'

_ROW_TITLES = {
    "progress": "Progress",
    "goodput": "Goodput: where the wall time went",
    "throughput": "Throughput",
    "communication": "Communication",
    "elasticity": "Elasticity and failures",
    "checkpoints": "Checkpoints",
}
# names.py units -> Grafana unit ids. A unit missing here fails generation, on purpose.
_GRAFANA_UNITS = {
    "steps": "none",
    "loss": "none",
    "rate": "none",
    "bool": "none",
    "tokens/s": "short",
    "s": "s",
    "bytes": "bytes",
    "ratio": "none",
    "workers": "none",
    "failures": "none",
    "drains": "none",
    "ranks": "none",
    "moves": "none",
    "checkpoints": "none",
    "norm": "none",
    "proofs": "none",
}
# Values that change only at step boundaries or plan changes read best as stairs.
_STEPPED = {"step", "world_size", "dp", "pp", "controller_state", "durable_checkpoint_step", "durable_failures"}

# Panel titles where the metric's name does not read well as one.
_TITLES = {
    "tokens_per_s": "tokens/s",
    "step_time_s": "step time",
    "comm_bytes": "comm bytes per step",
    "comm_time_s": "comm time per step",
    "exposed_comm_s": "exposed comm time per step",
    "eval_loss": "validation loss",
    "rank_pace": "pace per rank (1 = even)",
    "lr": "learning rate",
    "goodput_ratio": "goodput (training that counts / wall time)",
    "goodput_seconds": "wall time by bucket",
    "recovery_seconds": "recovery time (p50, p95 over the run)",
    "last_recovery_seconds": "last recovery, by phase",
    "snapshot_seconds": "snapshot time",
    "durable_checkpoint_seconds": "durable checkpoint time",
    "durable_failures": "durable checkpoints failed, by role",
    "world_size": "world size",
}

_WIDTH, _HEIGHT, _PER_ROW = 8, 8, 3


def _short(spec: MetricSpec) -> str:
    return spec.name.removeprefix("elastic_trainer_")


def _by(spec: MetricSpec) -> str:
    return ", ".join(spec.tag_keys)


def _legend(spec: MetricSpec) -> str:
    return " ".join("{{" + k + "}}" for k in spec.tag_keys)


def _target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": _DS, "expr": expr, "legendFormat": legend, "refId": ref}


def _targets(spec: MetricSpec) -> list[dict]:
    """PromQL for one metric's panel. Ray adds its own labels (WorkerId, NodeAddress, ...)
    to every series, so each query aggregates them away, keeping the metric's own tags."""
    name, sel = spec.prometheus_name, "{" + _RUN + "}"
    if spec.name == metric("controller_state").name:
        # One series per state, present only while the run is in it: a state timeline.
        return [_target(f"max by ({_by(spec)}) ({name}{sel}) == 1", "{{run}} {{state}}", "A")]
    if spec.kind == GAUGE:
        return [_target(f"max by ({_by(spec)}) ({name}{sel})", _legend(spec), "A")]
    if spec.kind == COUNTER:
        # Cumulative per run: failures are rare, and increase() misses the one
        # that creates the series.
        return [_target(f"sum by ({_by(spec)}) ({name}{sel})", _legend(spec), "A")]
    if spec.kind == HISTOGRAM:
        # Buckets are cumulative over the controller's life, which is the run's, so a
        # quantile of the raw buckets covers every recovery of the run.
        bucket = f"sum by (run, le) ({name}_bucket{sel})"
        return [_target(f"histogram_quantile(0.5, {bucket})", "{{run}} p50", "A"),
                _target(f"histogram_quantile(0.95, {bucket})", "{{run}} p95", "B")]
    raise ValueError(f"no panel for metric kind {spec.kind!r}")


def _panel(title: str, description: str, unit: str, targets: list[dict], kind: str = "timeseries",
           stepped: bool = False, axis_label: str = "") -> dict:
    custom: dict = {}
    if kind == "timeseries":
        custom = {"lineInterpolation": "stepAfter" if stepped else "linear", "showPoints": "auto",
                  "axisLabel": axis_label}
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": _DS,
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"showLegend": True, "displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": targets,
    }


def _metric_panel(spec: MetricSpec) -> dict:
    kind = "state-timeline" if spec.name == metric("controller_state").name else "timeseries"
    title = _TITLES.get(_short(spec), _short(spec).replace("_", " "))
    axis = spec.unit if _GRAFANA_UNITS[spec.unit] in ("none", "short") else ""
    return _panel(title, spec.description, _GRAFANA_UNITS[spec.unit], _targets(spec), kind,
                  stepped=_short(spec) in _STEPPED, axis_label=axis)


def _derived_panels(group: str) -> list[dict]:
    """Panels that combine metrics; they sit after the group's one-per-metric panels."""
    if group == "elasticity":
        rec = metric("recovery_seconds")
        return [_panel("recoveries", "Recoveries and resizes so far, by what caused them.", "none",
                       [_target(f"sum by (run, reason) ({rec.prometheus_name}_count{{{_RUN}}})",
                                "{{run}} {{reason}}", "A")], stepped=True, axis_label="recoveries")]
    if group != "communication":
        return []
    comm, exposed, step = (metric(n).prometheus_name for n in ("comm_time_s", "exposed_comm_s", "step_time_s"))
    def share(m: str) -> str:
        return f"max by (run) ({m}{{{_RUN}}}) / max by (run) ({step}{{{_RUN}}})"

    return [_panel("share of step time communicating",
                   "Time in collectives (all of it, and the part not hidden behind compute) over step time.",
                   "percentunit",
                   [_target(share(comm), "{{run}} all", "A"),
                    _target(share(exposed), "{{run}} exposed", "B")])]


def build_dashboard() -> dict:
    """The Grafana dashboard: a row per group, a panel per metric, filtered by the ``run`` variable."""
    panels: list[dict] = []
    y, next_id = 0, 1
    for group in GROUPS:
        row = {"type": "row", "title": _ROW_TITLES[group], "collapsed": False, "panels": [],
               "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "id": next_id}
        panels.append(row)
        next_id, y = next_id + 1, y + 1
        members = [_metric_panel(m) for m in METRICS if m.group == group] + _derived_panels(group)
        for i, p in enumerate(members):
            p["id"] = next_id
            p["gridPos"] = {"h": _HEIGHT, "w": _WIDTH, "x": (i % _PER_ROW) * _WIDTH,
                            "y": y + (i // _PER_ROW) * _HEIGHT}
            next_id += 1
            panels.append(p)
        y += -(-len(members) // _PER_ROW) * _HEIGHT
    run_query = f"label_values({metric('controller_state').prometheus_name}, run)"
    return {
        "title": "elastic_trainer",
        "uid": "elastic-trainer",
        "description": "Generated by scripts/gen_dashboards.py from elastic_trainer/metrics/names.py; do not edit.",
        "tags": ["elastic_trainer", "ray"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "timezone": "",
        "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "regex": ""},
            {"name": "run", "label": "run", "type": "query", "datasource": _DS,
             "definition": run_query, "query": {"query": run_query, "refId": "run"},
             "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "sort": 1,
             "hide": 0, "regex": ""},
        ]},
        "panels": panels,
    }


def build_alerts() -> dict:
    """Prometheus alert rules: a stalled run, failures that keep coming, a recovery that never ends,
    durable checkpoints that fail to write."""
    step = metric("step").prometheus_name
    state = metric("controller_state").prometheus_name
    failures = metric("failures").prometheus_name
    durable = metric("durable_failures").prometheus_name
    stall, window, stuck = f"{STALL_MINUTES}m", f"{FAILURE_WINDOW_MINUTES}m", f"{RECOVERY_STUCK_MINUTES}m"
    recovering = 'state=~"RECOVERING|RESIZING"'
    return {"groups": [{"name": "elastic_trainer", "rules": [
        {
            "alert": "ElasticTrainerNoProgress",
            # Range functions still see a series for a while after the controller is
            # gone; the instant RUNNING check does not, so a finished run never fires.
            # The offset clause waits until the step has been exported for the whole window.
            "expr": (f"max by (run) (changes({step}[{stall}])) == 0\n"
                     f"and on (run) max by (run) ({step} offset {stall})\n"
                     f'and on (run) max by (run) ({state}{{state="RUNNING"}}) == 1\n'
                     f'and on (run) max by (run) (min_over_time({state}{{state="RUNNING"}}[{stall}])) == 1\n'),
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "elastic_trainer run {{ $labels.run }} made no step in " + stall,
                "description": (f"The controller of run {{{{ $labels.run }}}} has been RUNNING for {stall} and "
                                "its step has not changed: a worker or a collective may be hung."),
            },
        },
        {
            "alert": "ElasticTrainerFailuresRepeating",
            # Not increase(): it drops the first failure of each kind, the one that creates
            # the series. A series that did not exist a window ago counts from zero.
            "expr": (f"sum by (run) (\n  {failures}\n"
                     f"  - ({failures} offset {window} or {failures} * 0)\n) > {FAILURE_THRESHOLD}\n"),
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "elastic_trainer run {{ $labels.run }}: {{ $value }} failures in " + window,
                "description": (f"More than {FAILURE_THRESHOLD} worker failures in {window}: nodes keep "
                                "dying or a worker keeps raising; the run recovers each time but may not advance."),
            },
        },
        {
            "alert": "ElasticTrainerRecoveryStuck",
            "expr": (f"max by (run) ({state}{{{recovering}}}) == 1\n"
                     f"and on (run) max by (run) (min_over_time({state}{{{recovering}}}[{stuck}])) == 1\n"),
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "elastic_trainer run {{ $labels.run }} has been recovering for " + stuck,
                "description": ("The controller has not left RECOVERING or RESIZING in " + stuck
                                + ": it may be waiting for nodes (failure.wait_for_nodes_s) or retrying a "
                                "restore that keeps failing."),
            },
        },
        {
            "alert": "ElasticTrainerDurableCheckpointFailing",
            # The run goes on after a failed periodic checkpoint, so nothing else says that a
            # preemption now would lose everything since the last one that was written.
            "expr": (f"sum by (run, role) (\n  {durable}\n"
                     f"  - ({durable} offset {window} or {durable} * 0)\n) > 0\n"),
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "elastic_trainer run {{ $labels.run }}: a {{ $labels.role }} durable checkpoint failed",
                "description": (f"A durable checkpoint failed to write in the last {window}: the storage may be "
                                "full, unreachable or refusing writes. The run trains on; its durable_failed "
                                "event names the error and the newest checkpoint that was written."),
            },
        },
    ]}]}


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper, value: str):
    # PromQL over several lines reads best as a literal block.
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def render() -> dict[str, str]:
    """File name -> text of every generated file."""
    dashboard = json.dumps(build_dashboard(), indent=2) + "\n"
    header = "# Generated by scripts/gen_dashboards.py from elastic_trainer/metrics/names.py; do not edit.\n"
    alerts = header + yaml.dump(build_alerts(), Dumper=_Dumper, sort_keys=False, width=120,
                                default_flow_style=False)
    return {DASHBOARD_FILE: dashboard, ALERTS_FILE: alerts}
