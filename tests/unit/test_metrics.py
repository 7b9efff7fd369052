"""The metric specs and the RunMetrics recorder, with fake metric objects in place of Ray's."""

import pickle
import subprocess
import sys

import pytest

from elastic_trainer.metrics import COUNTER, HISTOGRAM, METRICS, STATES, MetricSpec, RunMetrics, metric, prometheus_names


class FakeMetric:
    def __init__(self, spec):
        self.spec = spec
        self.calls = []

    def _record(self, method, value, tags):
        assert set(tags) == set(self.spec.tag_keys), (self.spec.name, tags)
        self.calls.append((method, value, tags))

    def set(self, value, tags):
        self._record("set", value, tags)

    def inc(self, value, tags):
        self._record("inc", value, tags)

    def observe(self, value, tags):
        self._record("observe", value, tags)


@pytest.fixture
def recorder():
    made = {}

    def factory(spec):
        made[spec.name] = FakeMetric(spec)
        return made[spec.name]

    rec = RunMetrics("run-a", factory=factory)
    return rec, made


def calls(made, short):
    return made[metric(short).name].calls


def _counted(made, short):
    """The counter's increments, leaving out the zeros that create its series."""
    return [c for c in calls(made, short) if c[1] != 0]


RECORD = {"step": 7, "loss": 2.5, "cursor": 56, "dp": 2, "pp": 3, "world_size": 6, "plan": 0,
          "step_time_s": 0.5, "tokens_per_s": 1024.0, "comm_time_s": 0.125, "worker_s": 0.4, "comm_bytes": 4096,
          "time": 1700000000.0}


def test_names_are_prefixed_and_exported_names_follow_ray():
    assert all(m.name.startswith("elastic_trainer_") and "run" == m.tag_keys[0] for m in METRICS)
    names = prometheus_names()
    assert len(names) == len(set(names))
    assert "ray_elastic_trainer_step" in names and "ray_elastic_trainer_failures_total" in names
    assert {"ray_elastic_trainer_recovery_seconds_bucket", "ray_elastic_trainer_recovery_seconds_sum",
            "ray_elastic_trainer_recovery_seconds_count"} <= set(names)
    assert "ray_elastic_trainer_recovery_seconds" not in names
    assert metric("failures").kind == COUNTER and metric("recovery_seconds").kind == HISTOGRAM


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="must start with"):
        MetricSpec("step", "gauge", "", "steps", "progress", "step")
    with pytest.raises(ValueError, match="leave '_total' off"):
        MetricSpec("elastic_trainer_x_total", "counter", "", "1", "progress", "failure")
    with pytest.raises(ValueError, match="boundaries"):
        MetricSpec("elastic_trainer_h", "histogram", "", "s", "progress", "recovery")
    with pytest.raises(KeyError, match="no metric"):
        metric("nope")


def test_states_match_the_controller():
    from elastic_trainer.controller.controller import RunState

    assert STATES == tuple(s.value for s in RunState)


def test_importing_metrics_does_not_import_ray_and_recording_without_ray_does_nothing():
    code = ("import sys\n"
            "from elastic_trainer.metrics import RunMetrics\n"
            "r = RunMetrics('x')\n"
            "r.record_step({'step': 1, 'loss': 1.0})\n"
            "r.record_event({'kind': 'failure', 'failure': 'death'})\n"
            "r.set_state('RUNNING')\n"
            "assert not r.enabled\n"
            "assert 'ray' not in sys.modules, 'ray imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_record_step_sets_every_step_gauge_from_its_history_key(recorder):
    rec, made = recorder
    rec.record_step(RECORD)
    tags = {"run": "run-a"}
    assert calls(made, "step") == [("set", 7.0, tags)]
    assert calls(made, "loss") == [("set", 2.5, tags)]
    assert calls(made, "comm_time_s") == [("set", 0.125, tags)]
    assert calls(made, "comm_bytes") == [("set", 4096.0, tags)]
    assert [calls(made, k)[0][1] for k in ("dp", "pp", "world_size")] == [2.0, 3.0, 6.0]
    # Not in this record: left unset rather than set to a made-up value.
    assert calls(made, "exposed_comm_s") == [] and calls(made, "compression_ratio") == []
    rec.record_step({**RECORD, "exposed_comm_s": 0.05, "compression_ratio": 4})
    assert calls(made, "exposed_comm_s")[-1][1] == 0.05 and calls(made, "compression_ratio")[-1][1] == 4.0


def test_numpy_numbers_are_recorded_as_floats(recorder):
    np = pytest.importorskip("numpy")
    rec, made = recorder
    rec.record_step({"step": np.int64(3), "loss": np.float32(1.5)})
    assert calls(made, "step") == [("set", 3.0, {"run": "run-a"})]
    assert type(calls(made, "step")[0][1]) is float


def test_state_gauge_is_one_for_the_current_state_only(recorder):
    rec, made = recorder
    rec.record_event({"kind": "state", "from": "PENDING", "to": "RUNNING", "time": 1.0})
    values = {c[2]["state"]: c[1] for c in calls(made, "controller_state")}
    assert values == {s: (1.0 if s == "RUNNING" else 0.0) for s in STATES}
    rec.set_state("SOMETHING_NEW")
    last = {c[2]["state"]: c[1] for c in calls(made, "controller_state")[-len(STATES) - 1:]}
    assert last["SOMETHING_NEW"] == 1.0 and last["RUNNING"] == 0.0


def test_state_accepts_the_enum(recorder):
    from elastic_trainer.controller.controller import RunState

    rec, made = recorder
    rec.set_state(RunState.RECOVERING)
    assert [c[2]["state"] for c in calls(made, "controller_state") if c[1] == 1.0] == ["RECOVERING"]


def test_failures_are_counted_by_kind(recorder):
    rec, made = recorder
    for kind in ("death", "death", "hang", None):
        rec.record_event({"kind": "failure", "failure": kind, "worker": 1, "rank": 0, "node": "n", "step": 3})
    kinds = [c[2]["kind"] for c in _counted(made, "failures")]
    assert kinds == ["death", "death", "hang", "unknown"]
    assert all(c[0] == "inc" and c[1] == 1.0 for c in _counted(made, "failures"))


def test_a_recovery_is_observed_once_when_its_total_is_known(recorder):
    rec, made = recorder
    ev = {"kind": "recovery", "reason": "death", "failed_step": 5, "restored_step": 4, "detect_s": 0.5,
          "replan_s": 0.25, "restore_s": 1.0, "time": 10.0}
    rec.record_event(ev)   # as created: first step not yet done
    assert calls(made, "recovery_seconds") == []
    phases = {c[2]["phase"]: c[1] for c in calls(made, "last_recovery_seconds")}
    assert phases == {"detect": 0.5, "replan": 0.25, "restore": 1.0}
    ev.update(first_step_s=0.25, total_s=2.0)
    rec.record_event(ev)
    rec.record_event(ev)   # reported again: still one recovery
    assert calls(made, "recovery_seconds") == [("observe", 2.0, {"run": "run-a", "reason": "death"})]
    assert {c[2]["phase"]: c[1] for c in calls(made, "last_recovery_seconds")}["total"] == 2.0


def test_checkpoint_events_set_their_gauges(recorder):
    rec, made = recorder
    rec.record_event({"kind": "durable_checkpoint", "step": 20, "path": "/x", "seconds": 1.5, "bytes": 1 << 20})
    rec.record_event({"kind": "snapshot", "step": 10, "seconds": 0.25, "bytes": 2048})
    rec.record_event({"kind": "checkpoint_problem", "detail": "ignored"})
    assert calls(made, "durable_checkpoint_seconds")[-1][1] == 1.5
    assert calls(made, "durable_checkpoint_bytes")[-1][1] == float(1 << 20)
    assert calls(made, "durable_checkpoint_step")[-1][1] == 20.0
    assert calls(made, "snapshot_seconds")[-1][1] == 0.25 and calls(made, "snapshot_bytes")[-1][1] == 2048.0


def test_drains_are_counted_by_outcome_and_the_outcomes_are_the_controllers(recorder):
    import inspect

    from elastic_trainer.controller.replanning import drains
    from elastic_trainer.metrics.names import DRAIN_OUTCOMES

    rec, made = recorder
    rec.record_event({"kind": "drain", "node": "n", "outcome": "moved"})
    rec.record_event({"kind": "drain", "action": "moved off"})   # a follow-up: not counted again
    assert _counted(made, "drains") == [("inc", 1.0, {"run": "run-a", "outcome": "moved"})]
    source = inspect.getsource(drains)
    assert all(f'"{o}"' in source for o in DRAIN_OUTCOMES)


def test_goodput_sets_its_share_and_every_bucket(recorder):
    rec, made = recorder
    rec.record_goodput({"wall_s": 10.0, "effective_s": 9.0, "goodput": 0.9,
                        "seconds": {"training": 9.0, "restore": 1.0}})
    assert calls(made, "goodput_ratio")[-1][1] == 0.9
    assert {c[2]["bucket"]: c[1] for c in calls(made, "goodput_seconds")} == {"training": 9.0, "restore": 1.0}


def test_a_failing_backend_never_raises(caplog):
    class Broken:
        def set(self, *a, **k):
            raise RuntimeError("exporter down")

        inc = observe = set

    def factory(spec):
        if spec.name == metric("loss").name:
            raise RuntimeError("cannot create")
        return Broken()

    rec = RunMetrics("r", factory=factory)
    rec.record_step(RECORD)
    rec.record_step(RECORD)
    rec.record_event({"kind": "failure", "failure": "death"})
    assert "cannot create" in caplog.text and "exporter down" in caplog.text
    # Logged once per metric, not once per call.
    assert caplog.text.count("metric elastic_trainer_step not recorded") == 1


def test_a_pickled_recorder_leaves_its_metric_objects_behind(recorder):
    rec, made = recorder
    rec.record_step(RECORD)
    copy = pickle.loads(pickle.dumps(RunMetrics("run-b")))
    assert copy.run == "run-b" and not copy.enabled
    rec._factory = None   # a fake factory is a local closure and would not pickle
    clone = pickle.loads(pickle.dumps(rec))
    assert clone.run == "run-a" and clone._metrics is None


def test_refresh_sets_every_gauge_series_again_to_its_last_value(recorder):
    # Ray drops gauge series that are not set for a while; a stuck run must keep its last step.
    rec, made = recorder
    rec.record_step(RECORD)
    rec.record_step({**RECORD, "step": 8})
    rec.set_state("RUNNING")
    rec.record_event({"kind": "failure", "failure": "death"})
    rec.refresh()
    tags = {"run": "run-a"}
    assert calls(made, "step")[-1] == ("set", 8.0, tags)
    assert calls(made, "step").count(("set", 8.0, tags)) == 2
    running = [c for c in calls(made, "controller_state") if c[2].get("state") == "RUNNING"]
    assert running[-1][1] == 1.0 and len(running) == 2
    # Counters are cumulative in Ray: not replayed.
    assert len(_counted(made, "failures")) == 1


# -- counters exist from the start ---------------------------------------------------------------

def test_a_fresh_recorder_exports_every_counter_at_zero_under_every_label_set_it_will_count(recorder):
    # increase() and `offset` see a counter's first event only if its series already existed at 0.
    rec, made = recorder
    assert rec.enabled   # the metrics are made on first use, in the recording process
    counters = [m for m in METRICS if m.kind == COUNTER]
    assert {"failures", "rebalances", "stragglers"} <= {m.name.removeprefix("elastic_trainer_") for m in counters}
    for spec in counters:
        got = made[spec.name].calls
        assert got and all(method == "inc" and value == 0 for method, value, _ in got), spec.name
        assert all(tags["run"] == "run-a" for _, _, tags in got)
        assert len({tuple(sorted(t.items())) for _, _, t in got}) == len(got), f"{spec.name}: a series twice"
    kinds = {t["kind"] for _, _, t in calls(made, "failures")}
    actions = {t["action"] for _, _, t in calls(made, "rebalances")}
    assert {"death", "hang", "startup"} <= kinds and {"shares", "readmit"} <= actions
    # The first real failure increments a series that is already there, under the same labels.
    rec.record_event({"kind": "failure", "failure": "death"})
    assert _counted(made, "failures") == [("inc", 1.0, {"run": "run-a", "kind": "death"})]
    assert ("inc", 0.0, {"run": "run-a", "kind": "death"}) in calls(made, "failures")


def _emitted(kind: str, field: str) -> set[str]:
    """Every string the controller's sources can give ``field`` of a ``kind`` event: from
    ``ctl.event(kind, field=...)`` calls and ``{"kind": kind, field: ...}`` literals, following a
    loop variable back to the tuple it iterates over."""
    import ast
    from pathlib import Path

    import elastic_trainer.controller as controller_pkg

    found: set[str] = set()

    def strings(node):
        return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}

    for path in Path(controller_pkg.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        loops = {}   # loop variable name -> the strings its loop's tuple gives it
        for node in ast.walk(tree):
            if isinstance(node, ast.For) and isinstance(node.target, ast.Tuple) and isinstance(node.iter, ast.Tuple):
                for i, t in enumerate(node.target.elts):
                    if isinstance(t, ast.Name):
                        loops.setdefault(t.id, set()).update(
                            s for e in node.iter.elts if isinstance(e, ast.Tuple) for s in strings(e.elts[i]))
        for node in ast.walk(tree):
            value = None
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "event"
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == kind):
                value = next((k.value for k in node.keywords if k.arg == field), None)
            elif isinstance(node, ast.Dict):
                d = {k.value: v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)}
                if isinstance(d.get("kind"), ast.Constant) and d["kind"].value == kind:
                    value = d.get(field)
            if value is not None:
                found |= loops.get(value.id, set()) if isinstance(value, ast.Name) else strings(value)
    return found


@pytest.mark.parametrize("short, kind, field", [("failures", "failure", "failure"),
                                                ("rebalances", "rebalance", "action")])
def test_every_label_the_controller_counts_is_exported_at_zero(recorder, short, kind, field):
    rec, made = recorder
    assert rec.enabled
    emitted = _emitted(kind, field)
    assert len(emitted) >= 4, emitted   # the scan found the controller's events
    tag = metric(short).tag_keys[1]
    assert emitted <= {t[tag] for _, _, t in calls(made, short)}


def test_every_counter_the_dashboards_and_alerts_read_is_exported_at_zero(recorder):
    import json
    import re
    from pathlib import Path

    rec, made = recorder
    assert rec.enabled
    root = Path(__file__).parents[2] / "dashboards"
    text = (root / "alerts.yml").read_text() + json.dumps(json.loads((root / "elastic_trainer.json").read_text()))
    read = set(re.findall(r"ray_(elastic_trainer_\w+)_total", text))
    assert "elastic_trainer_failures" in read
    for name in read:
        assert made[name].calls and all(c[1] == 0 for c in made[name].calls), name


def test_a_failed_durable_checkpoint_is_counted_by_its_role(recorder):
    # The durable writer's roles are the counter's labels, so an alert can tell a periodic failure
    # (the run goes on) from a final one.
    import inspect

    from elastic_trainer.controller.state import durable_writer
    from elastic_trainer.metrics.names import DURABLE_ROLES

    source = inspect.getsource(durable_writer)
    assert all(f'"{role}"' in source for role in DURABLE_ROLES)
    rec, made = recorder
    assert rec.enabled
    assert {t["role"] for _, _, t in calls(made, "durable_failures")} == set(DURABLE_ROLES)
    rec.record_event({"kind": "durable_failed", "step": 8, "role": "periodic", "storage": "/x", "error": "full"})
    assert _counted(made, "durable_failures") == [("inc", 1.0, {"run": "run-a", "role": "periodic"})]
