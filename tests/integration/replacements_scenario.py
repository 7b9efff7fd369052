"""The autoscaler scenario of test_replacements, run as its own process
(``python -m tests.integration.replacements_scenario CORPUS LOG_DIR OUT``): a fresh driver, with
no Ray state of an earlier cluster in it, joins the autoscaling cluster. Writes what the test
checks to OUT as JSON."""

import json
import sys
import threading

import ray
from ray._private.utils import read_ray_address

from elastic_trainer import Trainer
from elastic_trainer.chaos.autoscaling_cluster import LocalAutoscalingCluster

from .test_recovery import config

_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 4}


def main(corpus_dir: str, log_dir: str, out: str) -> None:
    with LocalAutoscalingCluster(head_cpus=0, max_workers=3, system_config=_HEALTH_CHECKS, log_dir=log_dir) as c:
        ray.init(address=c.address)
        try:
            # No room at the start: the run asks, and waits for the autoscaler's nodes.
            cfg = config(corpus_dir, "asked", steps=100000, parallel={"dp": 2, "pp": 1},
                         scaling={"start_wait_s": 120, "placement_timeout_s": 180})
            seen = {"killed": None}
            stopped = threading.Event()

            def on_step(rec):
                ctl = ray.get_actor("asked-controller", namespace="elastic_trainer")
                if seen["killed"] is None and rec["step"] >= 5:
                    st = ray.get(ctl.status.remote())
                    seen["killed"] = next(w["node_id"] for w in st["workers"] if w["rank"] == 1)
                    c.kill_node(seen["killed"])
                elif seen["killed"] and rec["world_size"] == 2 and rec["plan"] > 1 and not stopped.is_set():
                    stopped.set()   # grown back onto the replacement: enough
                    ctl.stop.remote("grown back")

            result = Trainer(cfg, verbose=False, on_step=on_step).fit()
        finally:
            ray.shutdown()
    with open(out, "w") as f:
        json.dump({"address": c.address, "current": read_ray_address(), "stopped": result.stopped,
                   "grown_back": stopped.is_set(), "state": result.state, "killed": seen["killed"],
                   "asks": result.events.of("replacements").to_dicts(),
                   "recoveries": [e["reason"] for e in result.recoveries],
                   "failures": [{"failure": e["failure"], "node": e.get("node")} for e in result.events
                                if e["kind"] == "failure"],
                   "last_plan": result.plans[-1]}, f, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:4])
