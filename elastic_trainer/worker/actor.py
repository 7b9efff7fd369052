"""The Ray actor hosting one rank.

It is a threaded actor (max_concurrency > 1) so that its control methods
(``info``, ``ping``, ``shutdown``) answer while the training thread is inside a
step or blocked in a collective.
"""

from __future__ import annotations

import os
import socket

import ray
import torch

from ..config import TrainerConfig
from ..parallel.topology import Topology
from .process_group import destroy_groups, free_port, init_groups
from .stage import StageTrainer


class TrainWorker:
    def __init__(self, run_name: str, rank: int, torch_threads: int | None):
        self.run_name = run_name
        self.rank = rank
        if torch_threads is not None and not torch.cuda.is_available():
            torch.set_num_threads(torch_threads)
        self.trainer: StageTrainer | None = None

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "gpu_ids": ray.get_gpu_ids(),
        }

    def reserve_port(self) -> int:
        return free_port()

    def ping(self) -> bool:
        return True

    def setup(self, cfg_json: dict, dp: int, pp: int, stage_bounds: list[tuple[int, int]],
              master_addr: str, master_port: int) -> dict:
        """Join the process groups of a plan and build this rank's stage(s)."""
        cfg = TrainerConfig.model_validate(cfg_json)
        topo = Topology(dp, pp)
        device = torch.device("cuda", 0) if cfg.scaling.uses_gpu and torch.cuda.is_available() else torch.device("cpu")
        groups = init_groups(cfg.scaling.resolved_backend(), master_addr, master_port, topo, self.rank,
                             cfg.comm.timeout_s)
        self.trainer = StageTrainer(cfg, topo, self.rank, groups, stage_bounds, device)
        return {
            "rank": self.rank,
            "stages": self.trainer.stage_ids,
            "params": sum(p.numel() for p in self.trainer.params),
            "device": str(device),
        }

    def train_step(self, step: int) -> dict:
        r = self.trainer.train_step(step)
        return {"rank": self.rank, "loss": r.loss, "compute_s": r.compute_s, "comm_s": r.comm_s,
                "comm_bytes": r.comm_bytes}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.trainer.state_dict()

    def shutdown(self) -> None:
        self.trainer = None
        destroy_groups()
