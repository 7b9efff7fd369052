"""The run in the user's hands: ``Trainer.start()`` gives a ``Run`` to ask, wait on and stop;
``stop(save=True)`` (or ``elastic-trainer stop RUN`` from another process) ends it STOPPED at its
step, not FINISHED, with its weights and durable checkpoint, which a resume continues from; the result's records and events are typed; Ctrl-C in a driver process stops the
same way (as does SIGTERM, which `ray job stop` sends), and a second one ends it at once, saying
what was kept."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import ray

from elastic_trainer import Trainer
from elastic_trainer.checkpoint.durable import DurableStore
from elastic_trainer.checkpoint.weights import read_metadata
from elastic_trainer.naming import NAMESPACE, controller_name
from elastic_trainer.results import Event, StepRecord

from .test_recovery import config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
_MANY = 100000   # steps no test runs to: a run ends on its stop


def test_start_status_stop_and_resume_from_the_stop(cluster, corpus_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)   # MLflow keeps a new experiment's artifacts under ./mlruns
    storage = str(tmp_path / "ck")
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config(corpus_dir, "handle", steps=_MANY, parallel={"dp": 2, "pp": 1}, checkpoint={"storage": storage},
                 run={"output_dir": str(tmp_path / "out"), "trackers": ["tensorboard", "mlflow"],
                      "tensorboard_dir": str(tmp_path / "tb"), "mlflow_tracking_uri": mlflow_uri})
    third = threading.Event()
    run = Trainer(cfg, on_step=lambda rec: rec["step"] >= 3 and third.set()).start()
    assert third.wait(120), run.status()
    st = run.status()
    assert st["state"] == "RUNNING" and st["step"] >= 3 and st["plan"] is not None and "goodput" in st
    assert not run.wait(0.01) and not run.done
    with pytest.raises(TimeoutError, match="still running"):
        run.result(timeout=0.01)

    # Asked first as a user does from another process (`elastic-trainer stop RUN`), then through
    # the handle, whose request is not taken again: one stop, the CLI's.
    cli = subprocess.run([sys.executable, "-m", "elastic_trainer", "stop", "handle", "--address",
                          ray.get_runtime_context().gcs_address, "--reason", "from the test"],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and "stopping after the steps in flight" in cli.stdout, cli.stderr
    result = run.stop(save=True)
    assert run.done and result.state == "STOPPED" and result.stopped and 3 <= result.step < _MANY
    assert run.status()["state"] == "STOPPED" and not result.finished
    states = [e["to"] for e in result.events.of("state")]
    assert states[-1] == "STOPPED" and "FINISHED" not in states
    (stop,) = result.events.of("stop_requested")
    assert stop["reason"] == "from the test" and stop.step <= result.step
    out = capsys.readouterr().out
    assert f"!! stop requested at step {stop.step}" in out
    assert f"stopped at step {result.step} of {_MANY} (not finished)" in out and "\ndone:" not in out
    # Typed, and still the dicts they were.
    last = result.history[-1]
    assert isinstance(last, StepRecord) and last.step == result.step == last["step"] and last.loss > 0
    assert dict(last)["loss"] == last.loss and last.comm_share is not None
    assert all(isinstance(e, Event) for e in result.events)
    table = result.history.to_arrow()
    assert table.num_rows == len(result.history) and table.column("loss").to_pylist()[-1] == last.loss
    assert list(result.history.to_pandas()["step"]) == [r.step for r in result.history]
    # Nothing lost: weights and durable checkpoint of the step it stopped at, named on the result.
    ck = result.checkpoint
    assert ck.step == result.step and read_metadata(ck.weights)["step"] == result.step
    assert DurableStore(storage, result.run_id).load(result.step)[1]["step"] == result.step
    assert ck.path == result.durable_path and ck.path.endswith(f"step-{result.step:08d}-{result.run_id}")

    # The trackers saw the run, as their own readers show: each step's loss, the events, the config.
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "tb" / "handle"), size_guidance={"scalars": 0, "tensors": 0})
    tb.Reload()
    losses = {e.step: e.value for e in tb.Scalars("train/loss")}
    assert losses == pytest.approx({r.step: r.loss for r in result.history}, rel=1e-6)
    assert any(t.startswith("events/") for t in tb.Tags()["tensors"]), tb.Tags()
    client = MlflowClient(tracking_uri=mlflow_uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("elastic_trainer").experiment_id])
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "train/loss")] == \
        [r.step for r in result.history]
    assert mlrun.info.status == "KILLED" and mlrun.data.params["train.steps"] == str(_MANY)

    # A resume continues from the stop's step.
    more = config(corpus_dir, "handle", steps=result.step + 2, parallel={"dp": 2, "pp": 1},
                  checkpoint={"storage": storage}, run={"output_dir": str(tmp_path / "out2")})
    resumed = Trainer(more, verbose=False).fit(resume=ck.path, accept_change="train.steps")
    assert resumed.events.of("resume")[0].step == result.step and resumed.finished
    # The history carries the stopped run's steps on: each step once, none redone.
    assert [r.step for r in resumed.history] == list(range(1, result.step + 3))


_DRIVER = """
import sys
from elastic_trainer import Trainer, TrainerConfig
from tests.integration.test_recovery import config
cfg = config(sys.argv[1], "interrupted", steps={many}, parallel={{"dp": 2, "pp": 1}},
             checkpoint={{"storage": sys.argv[2], "durable_every": 2}}, run={{"output_dir": sys.argv[3]}})
r = Trainer(cfg).fit()
print(f"RESULT {{r.state}} {{r.step}} {{r.durable_path}}", flush=True)
"""


def _driver(corpus_dir, tmp_path) -> subprocess.Popen:
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-c", _DRIVER.format(many=_MANY), corpus_dir, str(tmp_path / "ck"),
                             str(tmp_path / "out")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_held(ctl) -> None:
    deadline = 120
    while not ray.get(ctl.fault_point.remote("held")):
        deadline -= 1
        assert deadline > 0, "the final save was not reached"
        threading.Event().wait(1)


def _read_until(proc, pattern: str, lines: list[str]) -> None:
    for line in proc.stdout:
        lines.append(line)
        if pattern in line:
            return
    raise AssertionError(f"the driver ended before {pattern!r}:\n" + "".join(lines[-60:]))


def test_sigterm_or_ctrl_c_in_the_driver_stops_saved_and_a_second_ends_at_once(cluster, corpus_dir, tmp_path):
    proc = _driver(corpus_dir, tmp_path)
    lines: list[str] = []
    try:
        _read_until(proc, "durable checkpoint of step 2", lines)
        proc.send_signal(signal.SIGTERM)   # as `ray job stop` ends a job's driver
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    out = "".join(lines) + out
    assert proc.returncode == 0, out[-4000:]
    assert "SIGTERM: stopping run 'interrupted'" in out and "Traceback" not in out, out[-4000:]
    state, step, path = next(ln for ln in out.splitlines() if ln.startswith("RESULT ")).split()[1:]
    assert state == "STOPPED" and int(step) >= 2
    store = DurableStore(str(tmp_path / "ck"), path.rsplit("-", 1)[1])
    assert store.load(int(step))[1]["step"] == int(step)

    # Twice: the run ends at once, unsaved, and says which checkpoint it keeps. Its final save is
    # held (a fault point), so the second Ctrl-C comes before the stop is through.
    again = tmp_path / "again"
    proc = _driver(corpus_dir, again)
    lines = []
    try:
        _read_until(proc, "durable checkpoint of step 2", lines)
        ctl = ray.get_actor(controller_name("interrupted"), namespace=NAMESPACE)
        ray.get(ctl.fault_point.remote("arm", "final_save"))
        proc.send_signal(signal.SIGINT)
        _read_until(proc, "Ctrl-C: stopping", lines)
        _wait_held(ctl)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    out = "".join(lines) + out
    assert proc.returncode != 0 and "RESULT" not in out, out[-4000:]
    kept = next(ln for ln in out.splitlines() if "Ctrl-C again: run 'interrupted' ended at once" in ln)
    assert "kept the durable checkpoint of step" in kept and str(again / "ck") in kept, kept
