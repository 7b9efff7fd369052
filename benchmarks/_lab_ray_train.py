"""Ray Train (TorchTrainer, DDP over gloo) on lab hosts: ``python _lab_ray_train.py CONFIG_JSON OUT_JSON``.

Run on the lab's head host by ``_lab_comm`` as a user's driver would be. The
workers train the demo blocks exactly as ``throughput.baseline_loop`` does (same
data, AdamW, one torch thread), one worker a host, their groups on the host's
link (``eth0``); rank 0's per-step seconds go to ``OUT_JSON``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _loop(config: dict) -> None:
    import ray.train
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, config["benchmarks"])
    from throughput import baseline_loop

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    times = baseline_loop(config["cfg"], rank, world, DDP)
    if rank == 0:
        Path(config["out"]).write_text(json.dumps(times))


def main(cfg_path: str, out: str) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    raw = json.loads(Path(cfg_path).read_text())
    workers = raw["parallel"]["dp"]
    ray.init(runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "eth0"}})
    with tempfile.TemporaryDirectory(prefix="lab-ray-train-") as storage:
        TorchTrainer(
            _loop, train_loop_config={"cfg": raw, "out": out, "benchmarks": str(HERE)},
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 1}),
            torch_config=TorchConfig(backend="gloo"),
            run_config=RunConfig(storage_path=storage, name="lab-ray-train"),
        ).fit()


if __name__ == "__main__":
    main(*sys.argv[1:3])
