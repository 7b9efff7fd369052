"""A run that ends well ends quietly: `elastic-trainer run` as the README runs the demo (a driver
starting a local Ray of its own, ending it after the run) prints no traceback of its workers being
ended. Killed while their threads ran, Ray's SIGTERM handler raised SystemExit in them, and
"Exception ignored ... SystemExit: 1" reached the driver's last lines; they now leave through
their own path (``TrainWorker.leave``) before the driver ends the cluster."""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import yaml

from ..conftest import tiny_config, weights_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_a_finished_run_prints_no_traceback(corpus_dir, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(tiny_config(
        corpus_dir, parallel={"dp": 2, "pp": 2}, train={"steps": 3},
        run={"name": "quiet-end", "log_every": 1, "output_dir": f"{weights_dir()}/quiet-end"})))
    # Short: Ray's socket paths under it must stay within AF_UNIX's 107 bytes. Ray's temp dir there
    # holds no address of a cluster started on this machine, so the driver starts its own.
    ray_tmp = tempfile.mkdtemp(prefix="etq-", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run([sys.executable, "-m", "elastic_trainer", "run", str(job)], env=env,
                              capture_output=True, text=True, timeout=240)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Started a local Ray instance" in out and "step     3/3" in out
    for alarming in ("Traceback", "Exception ignored", "SystemExit", "did not leave"):
        assert alarming not in out, out[-4000:]
