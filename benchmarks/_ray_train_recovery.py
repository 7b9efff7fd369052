"""Recovery of Ray Train (TorchTrainer, DDP) from the loss of a worker node.

Trains the demo GPT exactly like ``throughput.baseline_loop`` (same blocks, same
data in the same order, AdamW, one torch thread per worker, gloo) at dp=4 under
Ray Train, checkpointing every step (rank 0 saves model + optimizer + step and
reports it; every rank calls ``ray.train.report``). Once step ``kill_at_step``
is logged, the driver kills one worker node without grace, adds a replacement
and measures how long Ray Train takes to complete its first step after the
restart, and how many steps it had to redo.

Rank 0 logs every step it completes to a file (all workers share this machine's
disk) because Ray Train's ``Result.metrics`` is not something to rely on here.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

DP = 4
TIMEOUT_S = 360.0  # the whole measurement, kill and restart included
POLL_S = 0.02


def _train_loop(config: dict) -> None:
    """Ray Train worker loop: baseline_loop's step, plus per-step checkpoints and resume."""
    import shutil

    import ray.train
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.data.dataset import TokenDataset
    from elastic_trainer.data.splits import make_sampler
    from elastic_trainer.models import build_model
    from elastic_trainer.worker.stage import build_optimizer

    started = time.time()
    attempt = f"{os.getpid()}-{started:.3f}"  # new worker processes on every (re)start
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    log_path = config["log"]

    torch.set_num_threads(1)
    cfg = TrainerConfig.model_validate(config["cfg"])
    blocks, loss_fn = build_model(cfg.model, cfg.train.seed)
    module = nn.Sequential(*blocks)
    opt_state, start_step = None, 1
    checkpoint = ray.train.get_checkpoint()
    restored_step = None
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", map_location="cpu")
        module.load_state_dict(state["model"])
        opt_state = state["optimizer"]
        restored_step = int(state["step"])
        start_step = restored_step + 1
    model = DDP(module)
    opt = build_optimizer(model.parameters(), cfg.train)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    data = TokenDataset.open(cfg.data)
    sampler = make_sampler(cfg, data)
    gb, n_micro = cfg.train.global_batch_size, cfg.micro_batches

    def log(rec: dict) -> None:
        with open(log_path, "a") as f:
            f.write(json.dumps({"attempt": attempt, **rec}) + "\n")
            f.flush()

    if rank == 0:
        log({"event": "start", "time": started, "restored_step": restored_step})

    first = True
    for step in range(start_step, cfg.train.steps + 1):
        t0 = time.perf_counter()
        # Data cursor = (step - 1) * global batch: a resumed run sees the same rows.
        x, y = data.sample(sampler.replica_rows((step - 1) * gb, gb, world, rank))
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        opt.zero_grad(set_to_none=True)
        for i, (xm, ym) in enumerate(zip(x.chunk(n_micro), y.chunk(n_micro))):
            ctx_ = model.no_sync() if i < n_micro - 1 else _null()
            with ctx_:
                (loss_fn(model(xm), ym) / n_micro).backward()
        if cfg.train.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        dist.barrier()
        compute_s = time.perf_counter() - t0
        metrics = {"step": step}
        if rank == 0:
            tmp = tempfile.mkdtemp(prefix="rt-ckpt-")
            try:
                torch.save(
                    {"model": module.state_dict(), "optimizer": opt.state_dict(), "step": step},
                    Path(tmp) / "state.pt",
                )
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            log({"event": "step", "step": step, "time": time.time(), "first_after_restore":
                 first and restored_step is not None, "compute_s": compute_s})
        else:
            ray.train.report(metrics)
        first = False


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            pass
    return recs


def _step_times(recs: list[dict]) -> list[tuple[int, float]]:
    """(step, seconds since the previous step's completion) within one attempt's records."""
    return [(b["step"], b["time"] - a["time"]) for a, b in zip(recs, recs[1:])]


def run_ray_train_recovery(cfg_raw: dict, cluster, nodes: list, kill_at_step: int, steps: int) -> dict:
    """Train under Ray Train, kill a worker node after step ``kill_at_step``, measure the recovery.

    ``cluster`` is a running ``ray.cluster_utils.Cluster`` (head with 0 CPUs) the
    caller has ``ray.init``-ed to; ``nodes`` are its one-CPU worker nodes. The
    killed node is removed from ``nodes`` and its replacement appended, so the
    list stays the cluster's live worker nodes.
    """
    import ray.cloudpickle
    import ray.train
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if not 1 <= kill_at_step < steps:
        raise ValueError(f"kill_at_step({kill_at_step}) must be in [1, steps({steps}))")
    # Workers cannot import this file (benchmarks/ is no package on their path):
    # ship the train loop by value, like throughput.py's loop defined in __main__.
    if __name__ != "__main__":
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    raw = copy.deepcopy(cfg_raw)
    raw["parallel"] = {"dp": DP, "pp": 1}
    raw.setdefault("train", {})["steps"] = steps
    if raw.get("scaling", {}).get("num_workers") is not None:
        raw["scaling"]["num_workers"] = DP

    deadline = time.monotonic() + TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="ray-train-recovery-") as storage:
        log_path = Path(storage) / "steps.jsonl"
        trainer = TorchTrainer(
            _train_loop,
            train_loop_config={"cfg": raw, "log": str(log_path)},
            scaling_config=ScalingConfig(num_workers=DP, use_gpu=False, resources_per_worker={"CPU": 1}),
            torch_config=TorchConfig(backend="gloo"),
            run_config=RunConfig(
                storage_path=storage,
                name="bench-ray-train-recovery",
                failure_config=FailureConfig(max_failures=3),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
            ),
        )
        outcome: dict = {}

        def fit() -> None:
            try:
                outcome["result"] = trainer.fit()
            except BaseException as e:  # noqa: BLE001 - handed to the driver thread
                outcome["error"] = e

        thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
        thread.start()

        def check_alive(what: str) -> None:
            if "error" in outcome:
                raise RuntimeError(f"Ray Train failed {what}: {outcome['error']!r}") from outcome["error"]
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Ray Train recovery benchmark did not finish within {TIMEOUT_S:.0f}s ({what}); "
                    f"last log lines: {_read_log(log_path)[-3:]}"
                )

        # 1. Wait for step kill_at_step, then kill a node hosting a training worker.
        while not any(r.get("event") == "step" and r["step"] >= kill_at_step for r in _read_log(log_path)):
            check_alive(f"before step {kill_at_step}")
            if not thread.is_alive():
                raise RuntimeError(f"Ray Train finished before step {kill_at_step} was logged")
            time.sleep(POLL_S)
        # 4 one-CPU nodes for 4 one-CPU workers: every node hosts a worker, so the
        # last one does too.
        victim = nodes[-1]
        # The kill starts now; remove_node returns once the node's processes are gone.
        kill_time = time.time()
        cluster.remove_node(victim, allow_graceful=False)
        nodes.remove(victim)
        # Ray Train restarts the whole worker group and needs all 4 workers (one CPU
        # each) to fit again; without a replacement node it would wait forever.
        nodes.append(cluster.add_node(num_cpus=1))

        # 2. Wait for the run to finish.
        while thread.is_alive():
            check_alive("after the node kill")
            thread.join(timeout=0.5)
        check_alive("after the node kill")
        recs = _read_log(log_path)

    steps_recs = [r for r in recs if r.get("event") == "step"]
    starts = [r for r in recs if r.get("event") == "start"]
    doomed = {s["attempt"] for s in starts if s["time"] <= kill_time}  # running when the node died
    restarted = [s for s in starts if s["time"] > kill_time]
    before = [r for r in steps_recs if r["attempt"] in doomed]
    if not before:
        raise RuntimeError("no step was logged before the kill")
    if not restarted:
        raise RuntimeError(f"Ray Train never restarted after the kill; log: {recs[-5:]}")
    # The first restart resumed from the checkpoint Ray Train had registered; if that
    # restart failed too, a later one took over, and the last attempt ran to the end.
    restart, final = restarted[0], restarted[-1]
    restored_step = restart["restored_step"] if restart["restored_step"] is not None else 0
    new_attempts = {s["attempt"] for s in restarted}
    first_after = next((r for r in steps_recs if r["attempt"] in new_attempts), None)
    after = [r for r in steps_recs if r["attempt"] == final["attempt"]]
    if first_after is None or not after:
        raise RuntimeError("no step was logged after the restart")
    # The doomed attempt may finish the step in flight as the node dies, without
    # Ray Train registering its checkpoint: such a step counts as completed, and redone.
    last_before = max(r["step"] for r in before)

    # Steady step time before the kill: the last doomed attempt, steps 6.. up to the
    # kill (the step the kill overlaps is left out).
    pre = [r for r in before if r["attempt"] == before[-1]["attempt"] and r["time"] <= kill_time]
    pre_times = [dt for s, dt in _step_times(pre) if s > 5]
    # _step_times starts at the 2nd step after the restart: [2:] leaves out the first 3.
    after_times = [dt for _, dt in _step_times(after)[2:]]
    return {
        "kill_to_first_step_s": first_after["time"] - kill_time,
        "steps_redone": last_before - restored_step,
        "restored_step": restored_step,
        "steady_step_s": statistics.median(pre_times) if pre_times else float("nan"),
        "steady_step_s_after": statistics.median(after_times) if after_times else float("nan"),
        "steps_completed": max(r["step"] for r in steps_recs),
    }
