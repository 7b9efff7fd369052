"""RunMetrics inside an actor reaches Ray's Prometheus endpoint under exactly the names
``prometheus_names()`` promises (the names the dashboards and alerts are generated with)."""

import re
import time
import urllib.request

import pytest
import ray

from elastic_trainer.metrics import RunMetrics, prometheus_names
from elastic_trainer.metrics.names import FAILURE_KINDS
from elastic_trainer.worker.process_group import free_port

pytestmark = pytest.mark.integration

SERIES = re.compile(r"^(ray_elastic_trainer_\w+)\{(.*)\} (\S+)$", re.M)


@pytest.fixture
def metrics_port(own_ray):
    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process")
    port = free_port("127.0.0.1")
    # Export every second so the test does not wait out Ray's default ten.
    ray.init(num_cpus=1, include_dashboard=False, _metrics_export_port=port, _node_ip_address="127.0.0.1",
             _system_config={"metrics_report_interval_ms": 1000})
    yield port
    ray.shutdown()


@ray.remote(num_cpus=0)
class Recorder:
    def __init__(self, run: str):
        self.metrics = RunMetrics(run)

    def record(self) -> bool:
        m = self.metrics
        m.record_event({"kind": "state", "from": "STARTING", "to": "RUNNING", "time": 1.0})
        m.record_step({"step": 3, "loss": 1.5, "dp": 2, "pp": 1, "world_size": 2, "step_time_s": 0.5,
                       "tokens_per_s": 100.0, "comm_time_s": 0.1, "comm_bytes": 10, "exposed_comm_s": 0.05,
                       "compression_ratio": 2.0, "lr": 1e-3, "grad_norm": 0.7, "pace": {"0": 1.0, "1": 1.4},
                       "rank_peak_rss_bytes": {"0": 1e8, "1": 2e8}, "rank_peak_device_bytes": {"0": 5e7, "1": 6e7}})
        m.record_step({"eval_loss": 1.4})
        for _ in range(2):
            m.record_event({"kind": "failure", "failure": "death"})
        m.record_event({"kind": "recovery", "reason": "death", "detect_s": 1.0, "replan_s": 1.0, "restore_s": 1.0,
                        "first_step_s": 1.0, "total_s": 4.0, "time": 1.0})
        m.record_event({"kind": "snapshot", "step": 3, "seconds": 0.1, "bytes": 5})
        m.record_event({"kind": "snapshot_interval", "step": 3, "interval": 4, "redo_steps": 5,
                        "snapshot_cost_s": 0.01})
        m.record_event({"kind": "durable_checkpoint", "step": 3, "seconds": 0.2, "bytes": 6})
        m.record_event({"kind": "straggler", "rank": 1, "step": 3, "pace": 1.4})
        m.record_event({"kind": "rebalance", "step": 3, "action": "shares", "shares": [6, 2]})
        m.record_event({"kind": "drain", "node": "n", "step": 3, "outcome": "moved"})
        m.record_event({"kind": "anomaly", "anomaly": "spike", "step": 3, "action": "skip"})
        m.record_event({"kind": "corruption", "step": 3, "suspects": [1], "quarantined": ["n"]})
        m.record_goodput({"wall_s": 10.0, "effective_s": 9.0, "goodput": 0.9,
                          "seconds": {"training": 9.0, "restore": 1.0}})
        return m.enabled


def _scrape(port: int) -> dict[str, list[tuple[str, float]]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, list[tuple[str, float]]] = {}
    for name, labels, value in SERIES.findall(text):
        out.setdefault(name, []).append((labels, float(value)))
    return out


def test_recorded_metrics_are_exported_under_the_promised_names(metrics_port):
    actor = Recorder.remote("export-test")
    assert ray.get(actor.record.remote())
    want = set(prometheus_names())
    deadline = time.time() + 60
    while True:
        got = _scrape(metrics_port)
        if want <= set(got) or time.time() > deadline:
            break
        time.sleep(1)
    assert set(got) == want, f"missing {sorted(want - set(got))}, unexpected {sorted(set(got) - want)}"
    assert got["ray_elastic_trainer_step"] == [(got["ray_elastic_trainer_step"][0][0], 3.0)]
    assert 'run="export-test"' in got["ray_elastic_trainer_step"][0][0]
    # Every kind is exported from the start, at 0 until it happens (increase() sees the first).
    failures = {re.search(r'kind="([^"]*)"', labels).group(1): v
                for labels, v in got["ray_elastic_trainer_failures_total"]}
    assert failures == {**dict.fromkeys(FAILURE_KINDS, 0.0), "death": 2.0}
    drains = {re.search(r'outcome="([^"]*)"', labels).group(1): v
              for labels, v in got["ray_elastic_trainer_drains_total"]}
    assert drains == {"moved": 1.0, "loss": 0.0, "idle": 0.0}
    buckets = {re.search(r'bucket="([^"]*)"', labels).group(1): v
               for labels, v in got["ray_elastic_trainer_goodput_seconds"]}
    assert buckets == {"training": 9.0, "restore": 1.0} and got["ray_elastic_trainer_goodput_ratio"][0][1] == 0.9
    running = [v for labels, v in got["ray_elastic_trainer_controller_state"] if 'state="RUNNING"' in labels]
    assert running == [1.0]
    # Gauges set once stay exported while the recording process lives (the alerts rely on it):
    # Ray drops a gauge series not set within two report intervals (2 s here), so the recorder
    # sets them again every 5 s; 8 s is past both.
    time.sleep(8)
    later = _scrape(metrics_port)
    assert "ray_elastic_trainer_durable_checkpoint_step" in later and later["ray_elastic_trainer_step"][0][1] == 3.0
