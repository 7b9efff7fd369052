"""Trackers: synthetic step records and events written through ``open_trackers`` and read back
with each tracker's own reader (TensorBoard's EventAccumulator, MLflow's client)."""

from __future__ import annotations

import sys
import time
from types import MappingProxyType

import pytest

from elastic_trainer.config import TrainerConfig
from elastic_trainer.errors import ConfigError
from elastic_trainer.storage.credentials import ENV
from elastic_trainer.trackers import check_trackers, open_trackers
from elastic_trainer.trackers.mlflow_writer import experiment_name, tracking_uri
from elastic_trainer.trackers.tensorboard_writer import log_dir

GOODPUT = {"wall_s": 10.0, "effective_s": 9.0, "goodput": 0.9,
           "seconds": {"training": 9.0, "restore": 0.75, "redone": 0.25}}
SECRET = "wJalrXUtnFEMI"


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory) -> str:
    """One SQLite store (MLflow's default kind) for the module: making its tables takes seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    # MLflow puts a new experiment's artifacts under the working directory (./mlruns).
    monkeypatch.chdir(tmp_path)


def _cfg(tmp_path, trackers, **run) -> TrainerConfig:
    return TrainerConfig.from_dict({"run": {"trackers": trackers, "report_dir": str(tmp_path / "reports"), **run},
                                    "data": {"path": str(tmp_path / "data")}, "train": {"lr": 3e-4}})


def _rec(step: int, loss: float, **more) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3 * step, "tokens_per_s": 1000.0 + step, "step_time_s": 0.5,
            "exposed_comm_s": 0.125, "comm_time_s": 0.25, "comm_bytes": 4096, "compression_ratio": None,
            "dp": 2, "pp": 2, "world_size": 4, "time": time.time(), **more}


def _feed(trackers) -> None:
    """Steps 1-5, a failure at 5, a recovery to step 3 that redoes 4 and 5 (new losses), a
    second failure at 4 after the rollback, an evaluation, and the run's end."""
    trackers.event({"kind": "state", "from": "STARTING", "to": "RUNNING", "time": time.time()})
    for s in range(1, 6):   # any mapping will do (the driver's records may be typed)
        trackers.step(_rec(s, 10.0 - s) if s % 2 else MappingProxyType(_rec(s, 10.0 - s)))
    trackers.event(MappingProxyType({"kind": "failure", "step": 5, "failure": "death", "worker": 3, "rank": 1,
                    "node": "0123456789abcdef", "time": time.time()}))
    trackers.event({"kind": "recovery", "reason": "failure", "plan_before": {"dp": 2, "pp": 2},
                    "plan_after": {"dp": 1, "pp": 2}, "sources": {"live": 4}, "restored_step": 3,
                    "steps_redone": 2, "detect_s": 0.5, "replan_s": 0.25, "restore_s": 0.125, "step": 3,
                    "time": time.time()})
    for s in (4, 5):
        trackers.step(_rec(s, 20.0 + s, dp=1, world_size=2))
    trackers.event({"kind": "failure", "step": 4, "failure": "error", "worker": 2, "rank": 0, "node": "fedcba98",
                    "time": time.time()})
    trackers.step(_rec(6, 26.0, dp=1, world_size=2))
    trackers.event({"kind": "eval", "step": 6, "loss": 2.5, "seconds": 0.1, "dp": 1, "pp": 2, "time": time.time()})
    trackers.event({"kind": "checkpoint_problem", "step": 6, "time": time.time(),
                    "detail": f"cannot write s3://AKIDEXAMPLE:{SECRET}@bucket/ckpt"})
    trackers.close("FINISHED", GOODPUT)


LATEST_LOSS = {1: 9.0, 2: 8.0, 3: 7.0, 4: 24.0, 5: 25.0, 6: 26.0}


def _tb(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _texts(acc, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def test_no_trackers_asked_is_a_no_op(tmp_path):
    trackers = open_trackers(_cfg(tmp_path, []), "quiet")
    assert not trackers and trackers.where == []
    _feed(trackers)
    assert not (tmp_path / "reports").exists()


def test_both_trackers_read_back(tmp_path, mlflow_uri, capsys):
    cfg = _cfg(tmp_path, ["tensorboard", "mlflow"], mlflow_tracking_uri=mlflow_uri)
    trackers = open_trackers(cfg, "gpt-tiny.both")
    assert [w.split(":")[0] for w in trackers.where] == ["tensorboard", "mlflow"]
    _feed(trackers)
    assert "warning" not in capsys.readouterr().err

    # TensorBoard: the reader takes the last value written at a step (a rollback's redone steps).
    acc = _tb(log_dir(cfg, "gpt-tiny.both"))
    assert {e.step: e.value for e in acc.Scalars("train/loss")} == LATEST_LOSS
    assert {e.step: e.value for e in acc.Scalars("layout/world_size")}[5] == 2
    assert [e.value for e in acc.Scalars("comm/share")] == [0.25] * 8
    assert acc.Scalars("train/lr")[0].value == pytest.approx(1e-3)
    assert acc.Scalars("throughput/tokens_per_s")[-1].value == 1006.0
    assert [(e.step, e.value) for e in acc.Scalars("train/eval_loss")] == [(6, 2.5)]
    assert [e.value for e in acc.Scalars("events/failure")] == [1, 2]
    assert acc.Scalars("goodput/ratio")[-1].value == pytest.approx(0.9)
    assert acc.Scalars("goodput/seconds/restore")[-1].value == pytest.approx(0.75)
    # Both failures are kept although the second came at an earlier step, and each names its step.
    failures = _texts(acc, "events/failure")
    assert [s for s, _ in failures] == [5, 6]
    assert "failure at step 5: death of worker 3" in failures[0][1] and "at step 4" in failures[1][1]
    assert "recovered: dp=2 pp=2 -> dp=1 pp=2" in _texts(acc, "events/recovery")[0][1]
    problem = _texts(acc, "events/checkpoint_problem")[0][1]
    assert "s3://***@bucket/ckpt" in problem and SECRET not in problem
    assert _texts(acc, "state")[-1][1] == "FINISHED"
    config = _texts(acc, "config")[0][1]
    assert "train.lr: 0.0003" in config and "run.trackers" in config
    assert "_hparams_/experiment" in acc.PluginTagToContent("hparams")

    # MLflow: every value logged, redone steps after the first, in order.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name("gpt-tiny")
    (run,) = client.search_runs([exp.experiment_id], filter_string="tags.`elastic_trainer.run` = 'gpt-tiny.both'")
    rid = run.info.run_id
    history = [(m.step, m.value) for m in client.get_metric_history(rid, "train/loss")]
    assert history == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 5.0), (4, 24.0), (5, 25.0), (6, 26.0)]
    assert dict(history) == LATEST_LOSS
    assert [m.value for m in client.get_metric_history(rid, "comm/share")] == [0.25] * 8
    assert [(m.step, m.value) for m in client.get_metric_history(rid, "train/eval_loss")] == [(6, 2.5)]
    assert [m.value for m in client.get_metric_history(rid, "events/failure")] == [1.0, 2.0]
    assert run.data.metrics["goodput/ratio"] == pytest.approx(0.9)
    assert run.data.metrics["goodput/seconds/redone"] == pytest.approx(0.25)
    assert run.info.status == "FINISHED" and run.data.tags["elastic_trainer.state"] == "FINISHED"
    assert run.data.params["train.lr"] == "0.0003" and run.data.params["parallel.dp"] == "1"
    events = open(client.download_artifacts(rid, "events.txt", str(tmp_path))).read().splitlines()
    assert [line.split("] ")[0].split(" [")[1] for line in events] == [
        "state", "failure", "recovery", "failure", "eval", "checkpoint_problem"]
    assert "step 4 [failure] failure at step 4: error of worker 2" in events[3]
    assert SECRET not in "\n".join(events) and "s3://***@bucket" in events[5]


def test_mlflow_names_its_experiment_and_a_stop(tmp_path, mlflow_uri):
    cfg = _cfg(tmp_path, ["mlflow"], mlflow_tracking_uri=mlflow_uri, mlflow_experiment="tiny-runs")
    trackers = open_trackers(cfg, "stopped-run")
    for s in (1, 2):
        trackers.step(_rec(s, 5.0))
    trackers.close("STOPPED", None)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tiny-runs").experiment_id])
    assert run.info.status == "KILLED" and run.data.tags["elastic_trainer.state"] == "STOPPED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2]
    assert "goodput/ratio" not in run.data.metrics


def test_experiment_and_uri_defaults(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, [])
    assert experiment_name(cfg, "gpt-small.run1") == "gpt-small"
    assert experiment_name(cfg, "et-20261207-174922") == "elastic_trainer"
    assert experiment_name(_cfg(tmp_path, [], mlflow_experiment="mine"), "gpt-small.run1") == "mine"
    assert log_dir(cfg, "r1") == str(tmp_path / "reports" / "tensorboard" / "r1")
    assert log_dir(_cfg(tmp_path, [], tensorboard_dir=str(tmp_path / "tb")), "r1") == str(tmp_path / "tb" / "r1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert tracking_uri(cfg) == "http://127.0.0.1:5999"
    # A password written into the URI is taken out of the config like a storage's, and put back
    # only for MLflow's client.
    monkeypatch.setenv(ENV, "{}")
    cfg = _cfg(tmp_path, [], mlflow_tracking_uri=f"https://alice:{SECRET}@127.0.0.1:5998/")
    assert SECRET not in cfg.model_dump_json()
    assert tracking_uri(cfg) == f"https://alice:{SECRET}@127.0.0.1:5998/"


def test_a_failing_tracker_warns_once_and_the_run_goes_on(tmp_path, mlflow_uri, capsys):
    (tmp_path / "file").write_text("not a directory")
    cfg = _cfg(tmp_path, ["tensorboard", "mlflow"], mlflow_tracking_uri=mlflow_uri,
               tensorboard_dir=str(tmp_path / "file" / "tb"))
    trackers = open_trackers(cfg, "failing.run")
    err = capsys.readouterr().err
    assert "tracker tensorboard could not start" in err and err.count("warning") == 1
    assert [w.split(":")[0] for w in trackers.where] == ["mlflow"]

    trackers.step(_rec(1, 3.0))
    trackers.flush()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("failing").experiment_id])
    client.delete_run(run.info.run_id)   # the store refuses writes to it from now on
    trackers.step(_rec(2, 2.0))
    trackers.flush()
    err = capsys.readouterr().err
    assert "tracker mlflow failed to write" in err and err.count("warning") == 1
    assert not trackers
    trackers.step(_rec(3, 1.0))
    trackers.event({"kind": "failure", "step": 3, "failure": "death", "worker": 0, "time": time.time()})
    trackers.close("FAILED", GOODPUT)
    assert capsys.readouterr().err == ""
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1]


def test_a_missing_package_fails_the_config_check(tmp_path, monkeypatch, mlflow_uri):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match=r"'tensorboard', but tensorboard is not installed: pip install "
                                          r"'elastic_trainer\[trackers\]'"):
        open_trackers(_cfg(tmp_path, ["tensorboard"]), "r")
    check_trackers(_cfg(tmp_path, ["mlflow"], mlflow_tracking_uri=mlflow_uri))
    monkeypatch.setitem(sys.modules, "alembic", None)
    with pytest.raises(ConfigError, match=r"database store that needs alembic"):
        check_trackers(_cfg(tmp_path, ["mlflow"], mlflow_tracking_uri=mlflow_uri))
    check_trackers(_cfg(tmp_path, ["mlflow"], mlflow_tracking_uri="http://127.0.0.1:5999"))
