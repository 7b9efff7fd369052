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
    kinds = [c[2]["kind"] for c in calls(made, "failures")]
    assert kinds == ["death", "death", "hang", "unknown"]
    assert all(c[0] == "inc" and c[1] == 1.0 for c in calls(made, "failures"))


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
    assert len(calls(made, "failures")) == 1
