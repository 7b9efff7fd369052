"""How a run ends: a stop asked from outside ends it STOPPED at its step with everything saved (not
FINISHED), and a durable write that fails mid-run is told on the driver while the run goes on."""

import subprocess
import sys

import pytest
import ray

from elastic_trainer import Trainer
from elastic_trainer.checkpoint.durable import DurableStore
from elastic_trainer.checkpoint.weights import load_weights, read_metadata
from elastic_trainer.controller.state.saving import SaveError
from elastic_trainer.naming import NAMESPACE, controller_name

from .test_recovery import config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# Far more steps than a stop asked at the first one lets run: the run ends on the stop, not here.
_MANY = 1000


def test_a_stopped_run_ends_stopped_at_its_step_with_its_weights_and_checkpoint_saved(cluster, corpus_dir, tmp_path,
                                                                                       capsys):
    storage = str(tmp_path / "ck")
    cfg = config(corpus_dir, "stopped", steps=_MANY, parallel={"dp": 2, "pp": 1},
                 checkpoint={"storage": storage}, run={"output_dir": str(tmp_path / "out")})
    asked: list[tuple] = []

    def stop_at_first_step(rec):
        if not asked:
            # As a user does, from another process: `elastic-trainer stop RUN`.
            cli = subprocess.run([sys.executable, "-m", "elastic_trainer", "stop", "stopped", "--address",
                                  ray.get_runtime_context().gcs_address, "--reason", "from the test"],
                                 capture_output=True, text=True, timeout=60)
            ctl = ray.get_actor(controller_name("stopped"), namespace=NAMESPACE)
            asked.append((rec["step"], cli, ray.get(ctl.stop.remote())))

    result = Trainer(cfg, on_step=stop_at_first_step).fit()
    last = result.history[-1]["step"]
    assert asked[0][0] <= last < _MANY
    states = [e["to"] for e in result.events if e["kind"] == "state"]
    assert states[-1] == "STOPPED" and "FINISHED" not in states   # before: RUNNING -> FINISHED
    cli = asked[0][1]
    assert cli.returncode == 0 and "stopping after the steps in flight" in cli.stdout, cli.stderr
    assert asked[0][2] is False   # a second request is not taken again
    assert result.state == "STOPPED" and result.stopped and not result.finished and result.step == last
    stop = [e for e in result.events if e["kind"] == "stop_requested"]
    assert len(stop) == 1 and asked[0][0] <= stop[0]["step"] <= last and stop[0]["reason"] == "from the test"
    # Nothing lost: the weights and the durable checkpoint of the step it stopped at.
    assert read_metadata(result.model_path)["step"] == last and load_weights(result.model_path)
    shards, manifest = DurableStore(storage, result.run_id).load(last)
    assert manifest["step"] == last and result.durable_path.endswith(f"step-{last:08d}-{result.run_id}")
    out = capsys.readouterr().out
    assert f"!! stop requested at step {stop[0]['step']}" in out
    assert f"stopped at step {last} of {_MANY} (not finished)" in out and "\ndone:" not in out


def test_a_durable_write_that_fails_mid_run_is_told_on_the_driver_as_it_happens(cluster, corpus_dir, tmp_path,
                                                                                capsys):
    (tmp_path / "file").write_text("in the way")
    storage = str(tmp_path / "file" / "ck")
    cfg = config(corpus_dir, "durable-fails", steps=4, checkpoint={"storage": storage, "durable_every": 2},
                 failure={"storage_retries": 0}, run={"output_dir": str(tmp_path / "out")})
    # The storage never comes back, so the final checkpoint fails the run at its end, as before.
    with pytest.raises(SaveError, match=r"did not save the final durable checkpoint of step 4"):
        Trainer(cfg).fit()
    out = capsys.readouterr().out
    # The mid-run write's failure reached the driver while the run went on: a line of its own.
    mid = [ln for ln in out.splitlines() if ln.startswith("!! durable checkpoint of step 2 failed")]
    assert len(mid) == 1, out
    mid = mid[0]
    assert "(the run goes on from memory; none written since the run started): NotADirectoryError" in mid
    assert out.index(mid) < out.index("!! durable checkpoint of step 4 failed")
