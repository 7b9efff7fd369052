"""Ray Train v2 (``TorchTrainer``, elastic) through a spot-churn trace: the peer of ``spot.py``.

Trains the demo GPT as ``_ray_train_recovery.py`` does (same blocks, data in the same order,
AdamW, DDP over gloo, one torch thread per worker) while ``_spot_trace.Replayer`` plays the trace
from rank 0's first logged step. The GLOBAL batch is the same in every step at any world size w:
rank r takes ``gb // w`` samples, plus one if ``r < gb % w`` (``replica_rows`` with ``shares``, in
rank order, so every split reads the same samples), cut into ``micro_batch_size`` micro-batches;
each micro-batch's mean loss is weighted by ``len * w / gb`` so that DDP's gradient average is
the global batch's mean. The logged loss is the global batch's mean (one scalar all-reduce).

Ray Train gets its best case, as its docs advise:

- elastic ``ScalingConfig(num_workers=(1, 4))``: it restarts with whatever fits (the trace keeps
  a node up) and grows back onto replacements, considered every ``resize_every_s`` (5 s; its
  default 60 s). Its view of the cluster comes from Ray Data's AutoscalingCoordinator, refreshed
  every 20 s and counting draining nodes, so it often asks for more workers than can be placed;
  ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=10`` (default 60) bounds each such try;
- ``FailureConfig(max_failures=-1, max_preemption_failures=-1)``: restarts forever, resuming
  from the latest reported checkpoint (``ray.train.get_checkpoint()``);
- a checkpoint every ``ckpt_every`` steps: rank 0 saves model + optimizer + step to a temp dir and
  reports it (SYNC upload to local storage under ``workdir``), the other ranks report metrics;
- its preemption watcher on (the default), polling the GCS's draining nodes every 1 s
  (``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S``, default 5 s). On a drain (the trace's notice) the
  controller goes to PREEMPTING, lets the workers train on until the drain deadline, then
  restarts the group (``PreemptionError``). Every ``notice_every`` steps (~1 s) all ranks call
  ``ray.train.get_preemption_info()`` (a collective: every rank, the same steps) and on a new
  notice save a just-in-time checkpoint and train on, as its docs advise;
- the controller polls the workers every 0.1 s (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, from 2 s,
  as ``recovery.py`` gives it): it paces reports, error detection and the deadline check.

Rank 0 logs each step it completes (``step, start, end, ckpt_s, world, attempt, loss,
notice_s``; ``notice_s``: the ``get_preemption_info`` call, part of the step) under ``workdir``;
steps redone after a restart are logged again and ``measure`` counts each step's last completion.
The environment variables must be set before ``trainer.fit()`` (read when the controller is
created); this module ``setdefault``s them on import.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1.0")
os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "10")

import _spot_trace  # noqa: E402
from _spot_trace import RayFleet, Replayer, measure, read_jsonl, write_jsonl  # noqa: E402

MAX_WORKERS = 4
MIN_WORKERS = 1
RESIZE_EVERY_S = 5.0
NOTICE_EVERY = 10  # steps between get_preemption_info() calls (~1 s at the demo's ~85 ms step)
POLL_S = 0.02


def shares(gb: int, world: int) -> list[int]:
    """Samples per rank of a global batch of ``gb``: equal, the first ``gb % world`` ranks one more."""
    return [gb // world + (1 if r < gb % world else 0) for r in range(world)]


def _train_loop(config: dict) -> None:
    import tempfile

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
    torch.set_num_threads(1)
    cfg = TrainerConfig.model_validate(config["cfg"])
    blocks, loss_fn = build_model(cfg.model, cfg.train.seed)
    module = nn.Sequential(*blocks)
    opt_state, restored = None, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", map_location="cpu")
        module.load_state_dict(state["model"])
        opt_state, restored = state["optimizer"], int(state["step"])
    model = DDP(module)
    opt = build_optimizer(model.parameters(), cfg.train)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    data = TokenDataset.open(cfg.data)
    sampler = make_sampler(cfg, data)
    gb, mb = cfg.train.global_batch_size, cfg.train.micro_batch_size
    split = shares(gb, world)
    if rank == 0:
        write_jsonl(config["attempts"], {"attempt": attempt, "time": started, "world": world,
                                         "restored_step": restored})

    def save(step: int) -> None:
        if rank == 0:
            tmp = tempfile.mkdtemp(prefix="rt-ckpt-")
            try:
                torch.save({"model": module.state_dict(), "optimizer": opt.state_dict(), "step": step},
                           Path(tmp) / "state.pt")
                ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(tmp))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        else:
            ray.train.report({"step": step})

    noticed = None
    for step in range(restored + 1, config["steps"] + 1):
        start = time.time()
        # Data cursor = (step - 1) * global batch: a resumed run, at any size, sees the same rows.
        x, y = data.sample(sampler.replica_rows((step - 1) * gb, gb, world, rank, shares=split))
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        opt.zero_grad(set_to_none=True)
        chunks = list(zip(x.split(mb), y.split(mb)))
        total = torch.zeros(1)
        for i, (xm, ym) in enumerate(chunks):
            with model.no_sync() if i < len(chunks) - 1 else contextlib.nullcontext():
                loss = loss_fn(model(xm), ym)
                (loss * (len(xm) * world / gb)).backward()
            total += loss.detach() * len(xm)
        if cfg.train.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        dist.all_reduce(total)
        t_notice = time.time()
        # A collective (all ranks, same steps): every notice_every steps, not to pay it each step.
        info = ray.train.get_preemption_info() if step % config["notice_every"] == 0 else None
        t_ckpt = time.time()
        fresh = info is not None and info.preempted_node_ids != noticed
        if fresh:
            noticed = info.preempted_node_ids
        if step % config["ckpt_every"] == 0 or fresh:
            save(step)
        end = time.time()
        if rank == 0:
            write_jsonl(config["log"], {
                "step": step, "start": start, "end": end, "ckpt_s": end - t_ckpt, "world": world,
                "attempt": attempt, "loss": total.item() / gb, "notice_s": t_ckpt - t_notice,
                "notice": sorted(info.preempted_ranks) if fresh else None})


def _controller_events(session_dir: str) -> list[dict]:
    """Restarts, start-up timeouts and group sizes from Ray Train's controller log (JSON lines)."""
    keys = ("[FailurePolicy]", "Started training worker group", "timed out", "Deciding to resize")
    out = []
    for path in glob.glob(os.path.join(session_dir, "logs", "train", "ray-train-app-controller-*.log")):
        for line in open(path, errors="replace"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            msg = rec.get("message", "")
            if any(k in msg for k in keys):
                lines = msg.split("\n")[:2 if "[FailurePolicy]" in msg else 1]
                out.append({"time": rec.get("asctime"), "what": " ".join(x.strip() for x in lines)[:160]})
    return out


def run_ray_train_spot(raw: dict, trace: list, cluster, nodes: list, steps: int, ckpt_every: int,
                       workdir: str, resize_every_s: float = RESIZE_EVERY_S,
                       notice_every: int = NOTICE_EVERY) -> dict:
    """Ray Train v2 through ``trace`` for ``steps`` steps; ``measure``'s numbers, with ``system``,
    ``restarts`` (worker-group starts after the first), ``worlds`` (sizes seen), ``trace_log``,
    ``losses`` (per counted step, in step order), ``notices`` (steps that saw a preemption notice
    and saved a checkpoint), ``attempts`` (rank 0's starts), ``notice_check_s`` (time in
    ``get_preemption_info``), ``controller`` and ``start_timeouts`` (from Ray Train's controller
    log: retries, group starts and sizes, start-up timeouts). ``cluster``/``nodes``: a running
    ``ray.cluster_utils.Cluster`` (head with 0 CPUs) the caller is connected to, and its four
    one-CPU worker nodes (slot i = ``nodes[i]``)."""
    import ray.cloudpickle
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    # Workers cannot import benchmarks/ (no package on their path): ship by value.
    for mod in (sys.modules[__name__], _spot_trace):
        if mod.__name__ != "__main__":
            ray.cloudpickle.register_pickle_by_value(mod)
    raw = copy.deepcopy(raw)
    raw["parallel"] = {"dp": MAX_WORKERS, "pp": 1}
    raw["train"]["steps"] = steps
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    log, attempts = work / "steps.jsonl", work / "attempts.jsonl"
    for p in (log, attempts):
        p.unlink(missing_ok=True)
    # Ray Train v2 resumes a run found at storage_path/name: start from scratch.
    shutil.rmtree(work / "storage", ignore_errors=True)
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={"cfg": raw, "steps": steps, "ckpt_every": ckpt_every,
                           "notice_every": notice_every, "log": str(log),
                           "attempts": str(attempts)},
        scaling_config=ScalingConfig(num_workers=(MIN_WORKERS, MAX_WORKERS), use_gpu=False,
                                     resources_per_worker={"CPU": 1},
                                     elastic_resize_monitor_interval_s=resize_every_s),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(
            storage_path=str(work / "storage"), name="spot-ray-train",
            failure_config=FailureConfig(max_failures=-1, max_preemption_failures=-1),
            checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    replayer = Replayer(trace, RayFleet(cluster, nodes))
    done = threading.Event()

    def watch() -> None:  # the trace starts once rank 0 has logged its first step
        while not done.is_set():
            if log.exists() and log.stat().st_size > 0:
                replayer.begin()
                return
            time.sleep(POLL_S)

    watcher = threading.Thread(target=watch, name="spot-ray-watch", daemon=True)
    watcher.start()
    wall_start = time.time()
    try:
        trainer.fit()
        wall_end = time.time()
    finally:
        done.set()
        replayer.stop()
        watcher.join(timeout=5)
    records = read_jsonl(log)
    starts = read_jsonl(attempts)
    out = measure(records, wall_start, wall_end)
    events = _controller_events(cluster.head_node.get_session_dir_path())
    last: dict[int, dict] = {}
    for r in records:
        last[r["step"]] = r
    out.update({
        "system": "Ray Train v2 TorchTrainer (elastic)",
        "restarts": max(0, len(starts) - 1),
        "worlds": sorted({s["world"] for s in starts}),
        "trace_log": replayer.log,
        "losses": [last[s]["loss"] for s in sorted(last)],
        "notices": [r["step"] for r in records if r.get("notice")],
        "attempts": starts,
        "notice_check_s": sum(r["notice_s"] for r in records),
        "controller": events,
        "start_timeouts": sum("timed out" in e["what"] for e in events),
    })
    return out
