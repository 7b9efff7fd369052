"""GPU check, parts 2 and 4: bf16 training steps at dp x pp on the GPU(s), and a rank killed on 2 GPUs.

Part 2 runs the demo GPT in bf16 at dp=2 x pp=2 twice:
- ``ranks``: four plain processes, each a ``StageTrainer`` on a CUDA device (the
  GPUs shared round-robin; NCCL where every rank has its own GPU, else gloo with
  host-staged ops, ``_gpu_transport``), against the same four on CPU: the
  losses must agree to bf16's precision. Comm time and exposed comm come from
  CUDA events.
- ``ray``: the product end to end (``Trainer``) on a local Ray head whose workers
  each take a GPU (``resources_per_worker: {GPU: 1}``, NCCL), as large a layout
  as the GPUs allow, snapshots every step (the device-to-host path in a worker).

Part 4 (at least 2 GPUs): dp=2 on two GPUs, a larger GPT so the step is mostly
its all-reduce; rank 1's process is SIGKILLed during a step. The survivor must
end its collectives (abort, or shrink where NCCL can), rejoin the next plan in
the same process, and the run finish. Reported: the recovery's seconds and
how the survivor rejoined.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from elastic_trainer.worker.process_group import free_port

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4


def demo_cfg(**overrides):
    import yaml
    from elastic_trainer.config import TrainerConfig

    raw = yaml.safe_load((ROOT / "jobs" / "demo.yaml").read_text())
    raw["data"]["path"] = os.path.abspath(os.path.expanduser(raw["data"]["path"]))
    raw["run"] = {"log_every": 10_000, "report_dir": None, "output_dir": None}
    raw["train"].update(steps=STEPS, precision="bf16")
    raw["scaling"].pop("backend", None)
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    return TrainerConfig.model_validate(raw)


def _rank(rank: int, world: int, port: int, device_kind: str, cfg_json: dict, out_dir: str) -> None:
    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.parallel.topology import Topology
    from elastic_trainer.planning.plan import make_plan
    from elastic_trainer.worker.process_group import destroy_groups, init_groups
    from elastic_trainer.worker.stage import StageTrainer

    torch.set_num_threads(1)
    cfg = TrainerConfig.model_validate(cfg_json)
    gpus = torch.cuda.device_count() if device_kind == "cuda" else 0
    if gpus:
        torch.cuda.set_device(rank % gpus)
        device = torch.device("cuda", rank % gpus)
    else:
        device = torch.device("cpu")
    backend = "nccl" if gpus >= world else "gloo"
    if gpus and backend == "gloo":
        import _gpu_transport
        _gpu_transport.install()
    plan = make_plan(cfg)
    topo = Topology(cfg.parallel.dp, cfg.parallel.pp)
    groups = init_groups(backend, "127.0.0.1", port, topo, rank, 120.0, device=device)
    trainer = StageTrainer(cfg, topo, rank, groups, plan.stage_bounds, device)
    rows = []
    for step in range(1, STEPS + 1):
        t0 = time.perf_counter()
        r = trainer.train_step(step)
        rows.append({"step": step, "loss": r.loss, "step_s": time.perf_counter() - t0, "comm_s": r.comm_s,
                     "exposed_comm_s": r.exposed_comm_s})
    trainer.close()
    destroy_groups()
    Path(out_dir, f"{device_kind}-{rank}.json").write_text(json.dumps({"backend": backend, "rows": rows}))


def run_ranks(device_kind: str, out_dir: str) -> dict:
    cfg = demo_cfg()
    from elastic_trainer.data.dataset import ensure_prepared
    ensure_prepared(cfg.data)
    world = cfg.parallel.dp * cfg.parallel.pp
    mp.start_processes(_rank, args=(world, free_port("127.0.0.1"), device_kind, cfg.model_dump(mode="json"), out_dir),
                       nprocs=world, join=True, start_method="spawn")
    per_rank = [json.loads(Path(out_dir, f"{device_kind}-{r}.json").read_text()) for r in range(world)]
    losses = [[row["loss"] for row in pr["rows"]] for pr in per_rank if pr["rows"][0]["loss"] is not None]
    worst = max(per_rank, key=lambda pr: sum(row["step_s"] for row in pr["rows"][1:]))
    return {"backend": per_rank[0]["backend"], "losses": losses[0],
            "step_s": sum(row["step_s"] for row in worst["rows"][1:]) / (STEPS - 1),
            "comm_s": max(row["comm_s"] for pr in per_rank for row in pr["rows"][1:]),
            "exposed_comm_s": max(row["exposed_comm_s"] for pr in per_rank for row in pr["rows"][1:])}


def part_ranks(out_dir: str) -> dict:
    gpu = run_ranks("cuda", out_dir)
    cpu = run_ranks("cpu", out_dir)
    diff = max(abs(a - b) / abs(b) for a, b in zip(gpu["losses"], cpu["losses"]))
    finite = all(l == l and abs(l) < 1e4 for l in gpu["losses"])
    return {"gpu": gpu, "cpu": cpu, "max_rel_loss_diff": diff, "ok": finite and diff < 0.02}


def _ray_layout(gpus: int) -> tuple[int, int]:
    return (2, 2) if gpus >= 4 else (2, 1) if gpus >= 2 else (1, 1)


def _state(result, cfg) -> str:
    """FINISHED when ``fit`` returned with every step done (it raises on a failed run)."""
    return "FINISHED" if result.history and result.history[-1]["step"] == cfg.train.steps else "incomplete"


def _resources(gpu: bool) -> dict:
    """A worker's resources: a GPU each (NCCL), or one CPU (gloo) for --self-test."""
    return {"resources_per_worker": {"CPU": 1, "GPU": 1}} if gpu else {"resources_per_worker": {"CPU": 1},
                                                                         "backend": "gloo"}


def part_ray(gpu: bool = True) -> dict:
    import ray
    from elastic_trainer import Trainer

    gpus = torch.cuda.device_count() if gpu else 4
    dp, pp = _ray_layout(gpus)
    cfg = demo_cfg(parallel={"dp": dp, "pp": pp}, scaling=_resources(gpu),
                   checkpoint={"memory_every": 1}, run={"name": "gpu-check-ray", "log_every": 10_000,
                                                        "report_dir": None, "output_dir": None},
                   train={"steps": 8, "precision": "bf16"})
    ray.init(num_cpus=max(4, dp * pp + 2), num_gpus=gpus if gpu else 0, include_dashboard=False,
             log_to_driver=False)
    try:
        result = Trainer(cfg, verbose=False).fit()
    finally:
        ray.shutdown()
    losses = [h["loss"] for h in result.history]
    steps = [h["step_time_s"] for h in result.history[2:]]
    state = _state(result, cfg)
    return {"layout": f"{dp}x{pp}", "state": state, "losses": losses,
            "step_s": sum(steps) / len(steps), "exposed_comm_s": result.history[-1].get("exposed_comm_s"),
            "ok": state == "FINISHED" and all(l == l for l in losses)}


def part_kill(gpu: bool = True) -> dict:
    import ray
    from elastic_trainer import Trainer
    from elastic_trainer.naming import NAMESPACE

    name = "gpu-check-kill"
    # On GPUs a larger GPT, so the step is mostly its all-reduce; the CPU self-test keeps the demo's.
    model = {"n_layer": 8, "d_model": 1024, "n_head": 16} if gpu else {}
    cfg = demo_cfg(model=model,
                   parallel={"dp": 2, "pp": 1}, scaling=_resources(gpu),
                   checkpoint={"memory_every": 1}, train={"steps": 30 if gpu else 16, "precision": "bf16"},
                   failure={"allow_fault_injection": True},
                   run={"name": name, "log_every": 10_000, "report_dir": None, "output_dir": None})
    killed: dict = {}

    def on_step(rec):
        if rec["step"] >= (10 if gpu else 6) and not killed:
            st = ray.get(ray.get_actor(f"{name}-controller", namespace=NAMESPACE).status.remote())
            victim = next(w for w in st["workers"] if w["rank"] == 1)
            killed.update(pid=victim["pid"], survivor=next(w["pid"] for w in st["workers"] if w["rank"] == 0))
            os.kill(victim["pid"], signal.SIGKILL)   # same machine: the pid is ours to signal

    ray.init(num_cpus=4, num_gpus=2 if gpu else 0, include_dashboard=False, log_to_driver=False)
    try:
        result = Trainer(cfg, on_step=on_step, verbose=False).fit()
    finally:
        ray.shutdown()
    rec = result.recoveries[0] if result.recoveries else {}
    kept = killed.get("survivor") in {w.get("pid") for w in result.workers}
    total = rec.get("total_s")
    state = _state(result, cfg)
    return {"state": state, "recovery_s": total, "detect_s": rec.get("detect_s"),
            "replan_s": rec.get("replan_s"), "restore_s": rec.get("restore_s"), "groups": rec.get("groups"),
            "survivor_kept_process": kept,
            "ok": state == "FINISHED" and kept and total is not None and total < 2.0}


def run(parts: set[str], gpu: bool = True) -> dict:
    """The parts asked for; ``gpu=False`` (--self-test) runs their plumbing on CPU workers."""
    out = {}
    with tempfile.TemporaryDirectory() as d:
        if "ranks" in parts:
            out["ranks"] = part_ranks(d)
    if "ray" in parts:
        out["ray"] = part_ray(gpu)
    if "kill" in parts:
        out["kill"] = (part_kill(gpu) if not gpu or torch.cuda.device_count() >= 2
                       else {"skipped": "fewer than 2 GPUs"})
    return out
