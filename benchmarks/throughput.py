"""Steady-state step time of the demo GPT at dp=4: elastic_trainer vs torchrun DDP vs Ray Train.

All three train the same blocks (the demo GPT), on the same data in the same
order, with AdamW, one torch thread per worker, gloo. elastic_trainer and Ray
Train run on a 4-node simulated Ray cluster (one CPU per node); torchrun runs
4 local processes. Run on a quiet machine:

    python benchmarks/throughput.py              # 3 rounds x 60 steps each, median of steps 21..60
    python benchmarks/throughput.py --steps 100 --warmup 30 --repeats 5

Prints a table with the ratios and writes benchmarks/results/throughput.json.
Targets: elastic_trainer within 10% of torchrun, no slower than Ray Train.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DP = 4


def demo_config(steps: int) -> dict:
    import yaml

    raw = yaml.safe_load((ROOT / "jobs" / "demo.yaml").read_text())
    raw["parallel"] = {"dp": DP, "pp": 1}
    raw["train"]["steps"] = steps
    raw["run"] = {"name": "bench-throughput", "log_every": 10_000, "report_dir": None}
    # Like for like: neither torchrun nor Ray Train checkpoints here. What per-step
    # snapshots cost is measured on its own by benchmarks/recovery.py.
    raw["checkpoint"] = {"memory_every": 10**9}
    return raw


# -- the baseline training loop, shared by torchrun and Ray Train -------------------
def baseline_loop(cfg_raw: dict, rank: int, world: int, wrap, slow: dict | None = None) -> list[float]:
    """Train the demo blocks under DDP (``wrap`` makes the DDP module); returns per-step seconds.
    ``slow``: ``{"rank", "factor", "from", "to"}`` makes that rank's passes ``factor`` times
    slower in steps ``from < step <= to``, as the trainer's straggler hook does."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.data.dataset import TokenDataset
    from elastic_trainer.data.splits import make_sampler
    from elastic_trainer.models import build_model
    from elastic_trainer.worker.stage import build_optimizer

    torch.set_num_threads(1)
    cfg = TrainerConfig.model_validate(cfg_raw)
    blocks, loss_fn = build_model(cfg.model, cfg.train.seed)
    model = wrap(nn.Sequential(*blocks))
    opt = build_optimizer(model.parameters(), cfg.train)
    data = TokenDataset.open(cfg.data)
    sampler = make_sampler(cfg, data)
    gb, n_micro = cfg.train.global_batch_size, cfg.micro_batches
    times = []
    for step in range(1, cfg.train.steps + 1):
        t0 = time.perf_counter()
        x, y = data.sample(sampler.replica_rows((step - 1) * gb, gb, world, rank))
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        opt.zero_grad(set_to_none=True)
        slowed = slow is not None and rank == slow["rank"] and slow["from"] < step <= slow["to"]
        for i, (xm, ym) in enumerate(zip(x.chunk(n_micro), y.chunk(n_micro))):
            ctx = model.no_sync() if i < n_micro - 1 else _null()
            t_m = time.perf_counter()
            with ctx:
                (loss_fn(model(xm), ym) / n_micro).backward()
            if slowed:
                time.sleep((slow["factor"] - 1.0) * (time.perf_counter() - t_m))
        if cfg.train.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        # Step time as the slowest rank sees it, like the controller's view of a step.
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def ddp_worker_main(cfg_path: str, out_path: str) -> None:
    """Entry point under torchrun."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg_raw = json.loads(Path(cfg_path).read_text())
    times = baseline_loop(cfg_raw, rank, world, lambda m: DDP(m))
    if rank == 0:
        Path(out_path).write_text(json.dumps(times))
    dist.destroy_process_group()


# -- the three contenders --------------------------------------------------------------
def run_torchrun(cfg_raw: dict) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, out_path = Path(tmp) / "cfg.json", Path(tmp) / "times.json"
        cfg_path.write_text(json.dumps(cfg_raw))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(DP),
             "--master_addr", "127.0.0.1", "--master_port", "29511",
             __file__, "--ddp-worker", str(cfg_path), str(out_path)],
            check=True, env=env,
        )
        return json.loads(out_path.read_text())


def run_elastic(cfg_raw: dict) -> list[float]:
    from elastic_trainer import Trainer, TrainerConfig

    result = Trainer(TrainerConfig.model_validate(cfg_raw), verbose=False).fit()
    return [r["step_time_s"] for r in result.history]


def run_ray_train(cfg_raw: dict, slow: dict | None = None) -> list[float]:
    import ray.train
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    def loop(config):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ctx = ray.train.get_context()
        times = baseline_loop(config["cfg"], ctx.get_world_rank(), ctx.get_world_size(), lambda m: DDP(m),
                              config["slow"])
        # Ray Train's Result carries metrics only alongside a checkpoint; all
        # workers share this machine's disk, so rank 0 leaves its timings in a file.
        if ctx.get_world_rank() == 0:
            Path(config["out"]).write_text(json.dumps(times))
        ray.train.report({"steps": len(times)})

    with tempfile.TemporaryDirectory() as storage:
        out = Path(storage) / "times.json"
        trainer = TorchTrainer(
            loop,
            train_loop_config={"cfg": cfg_raw, "out": str(out), "slow": slow},
            scaling_config=ScalingConfig(num_workers=DP, use_gpu=False, resources_per_worker={"CPU": 1}),
            torch_config=TorchConfig(backend="gloo"),
            run_config=RunConfig(storage_path=storage, name="bench-ray-train"),
        )
        trainer.fit()
        return json.loads(out.read_text())


def steady(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=20, help="steps of each run left out of the median")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of all three contenders")
    ap.add_argument("--ddp-worker", nargs=2, metavar=("CFG", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ddp_worker:
        ddp_worker_main(*args.ddp_worker)
        return
    if args.warmup >= args.steps:
        ap.error(f"--warmup({args.warmup}) must be below --steps({args.steps})")

    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.data.dataset import ensure_prepared

    cfg_raw = demo_config(args.steps)
    data = TrainerConfig.model_validate(cfg_raw).data
    data.path = os.path.abspath(os.path.expanduser(data.path))
    ensure_prepared(data)
    cfg_raw["data"]["path"] = data.path

    import ray
    from ray.cluster_utils import Cluster

    # One cluster for the whole benchmark; torchrun runs beside it while it idles,
    # so every contender sees the same background.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(DP):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    contenders = {"torchrun_ddp": run_torchrun, "elastic_trainer": run_elastic, "ray_train": run_ray_train}
    results: dict[str, list[list[float]]] = {k: [] for k in contenders}
    try:
        # Rounds interleave the contenders so drift in the machine's speed hits all of them.
        for rnd in range(args.repeats):
            for name, fn in contenders.items():
                print(f"round {rnd + 1}/{args.repeats}: {name} ...", flush=True)
                results[name].append(fn(cfg_raw))
    finally:
        ray.shutdown()
        cluster.shutdown()

    rounds = {k: [steady(t, args.warmup) for t in v] for k, v in results.items()}
    results = {k: [x for t in v for x in t[args.warmup:]] for k, v in results.items()}
    med = {k: statistics.median(v) for k, v in results.items()}
    tokens = cfg_raw["train"]["global_batch_size"] * cfg_raw["data"]["seq_len"]
    print(f"\ndemo GPT, dp={DP}, global batch {cfg_raw['train']['global_batch_size']} x {cfg_raw['data']['seq_len']} "
          f"tokens; median step time over steps {args.warmup + 1}..{args.steps} of {args.repeats} rounds")
    print(f"{'':<18}{'step ms':>10}{'tok/s':>10}{'vs torchrun':>13}   per-round medians (ms)")
    for k, v in med.items():
        per = " ".join(f"{x * 1000:.1f}" for x in rounds[k])
        print(f"{k:<18}{v * 1000:>10.1f}{tokens / v:>10,.0f}{v / med['torchrun_ddp']:>12.3f}x   {per}")
    ratio_t = med["elastic_trainer"] / med["torchrun_ddp"]
    ratio_r = med["elastic_trainer"] / med["ray_train"]
    print(f"\nelastic_trainer / torchrun  = {ratio_t:.3f} (target <= 1.10: {'met' if ratio_t <= 1.10 else 'NOT met'})")
    print(f"elastic_trainer / Ray Train = {ratio_r:.3f} (target <= 1.00: {'met' if ratio_r <= 1.00 else 'NOT met'})")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "throughput.json").write_text(json.dumps(
        {"steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "median_step_s": med,
         "round_median_step_s": rounds}, indent=1))


if __name__ == "__main__":
    main()
