"""``benchmarks/data.py --train``: the trainer on a corpus, in its own process and local Ray cluster.

Measures what a user sees: time from ``fit()`` to the first step, every worker's peak
RSS (VmHWM, read from /proc while the run is at its last steps), and steady tokens/s
(median over the second half of the steps). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data import rss_mib  # noqa: E402 - benchmarks/data.py, beside this file


def main(path: str, steps: int, read_ahead_mb: float, vocab: int) -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from elastic_trainer import Trainer, TrainerConfig
    from elastic_trainer.naming import NAMESPACE

    name = f"databench-{os.getpid()}"
    cfg = TrainerConfig.from_dict({
        "run": {"name": name, "log_every": 1000, "report_dir": None,
                "output_dir": f"/tmp/et-bench-data-weights/{name}"},
        # A small GPT over the generated tokens' range.
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": vocab},
        "data": {"path": path, "seq_len": 128, "read_ahead_mb": read_ahead_mb},
        "train": {"steps": steps, "global_batch_size": 16, "micro_batch_size": 4, "lr": 1e-3},
        "parallel": {"dp": 1, "pp": 2},
        "checkpoint": {"memory_every": 50},
    })
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR")
    peaks: dict[int, float] = {}

    def on_step(rec):
        if rec["step"] >= steps - 5:
            st = ray.get(ray.get_actor(f"{name}-controller", namespace=NAMESPACE).status.remote())
            for w in st["workers"]:
                v = rss_mib("VmHWM", w["pid"])
                if v is not None:
                    peaks[w["rank"]] = max(peaks.get(w["rank"], 0.0), v)

    t0 = time.time()
    result = Trainer(cfg, verbose=False, on_step=on_step).fit()
    first = result.history[0]["time"] - t0
    steady = result.history[len(result.history) // 2:]
    print(json.dumps({"first_step_s": first, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
                      "step_ms": 1000 * statistics.median(r["step_time_s"] for r in steady),
                      "worker_peak_rss_mib": {str(k): v for k, v in sorted(peaks.items())}}))
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
