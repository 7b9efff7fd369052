"""The demo job through ``ray job submit`` on a real Ray head with 4 CPUs (dashboard on 127.0.0.1),
with no extra flags: it succeeds, its logs show progress and where the weights went, ``elastic-trainer status`` reads it while it runs,
and its metrics reach the head's Prometheus export port."""

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from elastic_trainer.worker.process_group import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
_SECRET = "hf_Zq8sEcReTvAlUe"
STEP_SERIES = re.compile(r'^ray_elastic_trainer_step\{[^}]*run="jobtest"[^}]*\} (\S+)$', re.M)


@pytest.fixture
def ray_head(own_ray, tmp_path):
    import ray

    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process")
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    ports = {"gcs": free_port("127.0.0.1"), "dashboard": free_port("127.0.0.1"), "metrics": free_port("127.0.0.1")}
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           # Export every second, so the metrics show up while a short job runs.
           "RAY_metrics_report_interval_ms": "1000",
           # A token of the test's own for the head and every client: `ray start` turns token
           # authentication on only where ~/.ray/auth_token already exists, which a fresh machine lacks.
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env.pop("RAY_ADDRESS", None)
    # Short: Ray's socket paths under it must stay within the 107-byte limit of AF_UNIX.
    temp_dir = tempfile.mkdtemp(prefix="etjob-", dir="/tmp")
    # --block keeps `ray start` in the foreground; ending its process group stops this head
    # alone (`ray stop` would stop every Ray on the machine).
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={ports['gcs']}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}",
         f"--metrics-export-port={ports['metrics']}", "--num-cpus=4", "--disable-usage-stats",
         f"--temp-dir={temp_dir}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{ports['dashboard']}/api/version", timeout=2)
                break
            except urllib.error.HTTPError:
                break  # it answers (perhaps asking for the token): it is up
            except OSError:
                if head.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the Ray head did not come up (exit code {head.poll()})") from None
                time.sleep(0.5)
        yield ray_bin, ports, env
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            # A graceful stop of the head takes ~30 s; nothing of it is kept, so 5 s, then SIGKILL.
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _scrape_step(port: int) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    found = STEP_SERIES.findall(text)
    return max(float(v) for v in found) if found else None


def test_demo_job_submitted_through_ray_job_submit(ray_head, tmp_path):
    ray_bin, ports, env = ray_head
    # The demo as a user's job file that hands the workers a token: a secret belongs in the file
    # (a command line is listed with the job and in `ps`).
    job = yaml.safe_load((ROOT / "jobs" / "demo.yaml").read_text())
    job["scaling"]["env_vars"] = {"HF_TOKEN": _SECRET}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    entrypoint = (f"{sys.executable} -m elastic_trainer run {tmp_path / 'job.yaml'} "
                  "--set train.steps=80 --set run.log_every=10 --set run.name=jobtest "
                  f"--set run.report_dir={tmp_path}")
    # Blocking submit: it follows the job's logs until the job ends, as a user would see them.
    submit = subprocess.Popen(
        [ray_bin, "job", "submit", "--address", f"http://127.0.0.1:{ports['dashboard']}", "--", *entrypoint.split()],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    step_metric, status_out = None, None
    deadline = time.monotonic() + 300
    try:
        while submit.poll() is None and time.monotonic() < deadline:
            if step_metric is None or step_metric < 2:
                step_metric = _scrape_step(ports["metrics"]) or step_metric
            if status_out is None and step_metric:
                # The status command, from another process, while the run is live.
                status_out = subprocess.run(
                    [sys.executable, "-m", "elastic_trainer", "status", "--address", f"127.0.0.1:{ports['gcs']}"],
                    env=env, capture_output=True, text=True, timeout=120).stdout
            time.sleep(0.5)
        logs, _ = submit.communicate(timeout=30)
    finally:
        if submit.poll() is None:
            submit.kill()
    assert "succeeded" in logs.lower() and submit.returncode == 0, logs[-3000:]
    # Progress in the job's logs: plain periodic lines (no live bar in a log).
    assert "step    10/80" in logs and "step    80/80" in logs and "\r" not in logs
    # Each step judged and the replicas checked (integrity's defaults) on one node: no false alarm
    # (an anomaly or a corruption prints a line starting "!!").
    assert "anomalous" not in logs and "corruption" not in logs, logs[-3000:]
    assert "run jobtest: final loss" in logs
    # No flags for the one node: the workers are packed onto it, and the run says what that means.
    assert "placement: 4 workers on 1 node: losing that node loses every copy" in logs
    assert f"weights: {tmp_path / 'jobtest'}\n" in logs
    assert (tmp_path / "jobtest" / "model.safetensors.index.json").exists()
    assert f"run report: {tmp_path / 'jobtest.png'}" in logs and (tmp_path / "jobtest.png").exists()
    # The run's metrics on the head's export port, while it ran.
    assert step_metric is not None and step_metric >= 1, "no ray_elastic_trainer_step series for the run"
    assert status_out is not None and "run jobtest: RUNNING" in status_out, status_out
    assert "plan dp=2 x pp=2" in status_out and "rank 3: worker" in status_out
    # A head started plainly: the workers' own environment preloads jemalloc (worker.allocator).
    assert "MiB on jemalloc" in status_out, status_out
    # A secret-named env_vars entry reached the workers without Ray listing it: the actors'
    # details (runtime environments included), as any client of the cluster reads them.
    actors = subprocess.run([ray_bin, "list", "actors", "--detail", "--limit", "1000", "--address",
                             f"http://127.0.0.1:{ports['dashboard']}"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert actors.returncode == 0 and "TrainWorker" in actors.stdout, actors.stdout[-2000:] + actors.stderr[-2000:]
    assert _SECRET not in actors.stdout and _SECRET not in logs and _SECRET not in status_out
