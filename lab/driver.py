"""A training run's driver on a lab host: ``python -m lab.driver CONFIG_JSON OUT_DIR``.

Runs on the head host (``Lab.run``), as a user's driver would. It writes each
step as it is seen to ``OUT_DIR/progress.jsonl`` (the test or benchmark outside
the lab times its faults on it) and the run's result to ``OUT_DIR/result.json``.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

from elastic_trainer import Trainer
from elastic_trainer.config import TrainerConfig


def ranks_by_address(run_name: str) -> dict[int, str]:
    """rank -> the address of the host its worker runs on, as the run's controller says now."""
    import ray

    from elastic_trainer.naming import NAMESPACE

    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    st = ray.get(ray.get_actor(f"{run_name}-controller", namespace=NAMESPACE).status.remote(), timeout=30)
    return {w["rank"]: ips.get(w["node_id"]) for w in st["workers"] if w["rank"] is not None}


def main(cfg_path: str, out_dir: str) -> int:
    out = Path(out_dir)
    cfg = TrainerConfig.from_dict(json.loads(Path(cfg_path).read_text()))
    progress = open(out / "progress.jsonl", "a", buffering=1)

    seen_plan = [None]

    def on_step(rec: dict) -> None:
        line = {"step": rec["step"], "time": time.time(), "loss": rec.get("loss"), "plan": rec.get("plan")}
        if rec.get("plan") != seen_plan[0]:
            # Where each rank runs, by host address: what a fault outside the lab is aimed by.
            seen_plan[0] = rec.get("plan")
            line["ranks"] = ranks_by_address(cfg.run.name)
        progress.write(json.dumps(line) + "\n")

    try:
        result = Trainer(cfg, verbose=False, on_step=on_step).fit()
    except Exception as e:  # noqa: BLE001 - the caller reads the failure from the file
        (out / "result.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}",
                                                     "traceback": traceback.format_exc()}))
        return 1
    keep = ("history", "events", "plan", "plans", "workers", "state", "step", "run_id", "model_path", "durable_path")
    doc = {k: getattr(result, k) for k in keep}
    doc["history"], doc["events"] = result.history.to_dicts(), result.events.to_dicts()
    doc["recoveries"], doc["failures"] = result.recoveries.to_dicts(), result.failures.to_dicts()
    (out / "result.json").write_text(json.dumps(doc, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
