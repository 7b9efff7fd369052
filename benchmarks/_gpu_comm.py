"""GPU check, part 1: every codec and algorithm on CUDA tensors across processes, against the same on CPU.

Each of ``procs`` processes draws the same per-rank inputs for three steps and
averages them twice through one default group: once as CPU tensors (gloo),
once as CUDA tensors (NCCL where every rank has a GPU of its own, else gloo,
with the ops gloo cannot do on CUDA staged through the host, ``_gpu_transport``).
A codec's state (error-feedback residuals, PowerSGD's Q) carries across the
steps, so the state's device path is checked too. Reported per codec: the
largest difference of the CUDA result from the CPU one, relative to the
largest CPU value, over ranks and steps, and the comm time the CUDA run
counted (CUDA events).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_trainer.worker.process_group import free_port

NUMEL = 1 << 18
SHAPES = [(0, (256, 512)), (131072, (512, 200)), (233472, (28672,))]  # two matrices and a vector: 262144
OPTIONS = {"int8": {"chunk": 1024}, "topk": {"ratio": 0.01}, "powersgd": {"rank": 4}}
# What separates CUDA from CPU arithmetic (reduction order, rounding at a quantization boundary,
# QR from another library), relative to the largest value; anything wrong is far beyond it.
TOLERANCE = {"none": 1e-5, "fp16": 2e-3, "bf16": 1e-2, "int8": 2e-2, "topk": 1e-4, "powersgd": 2e-3,
             "ring": 1e-5, "tree": 1e-5, "chunked": 1e-5}
STEPS = 3


def _inputs(rank: int, step: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * rank + step))


def _worker(rank: int, procs: int, port: int, device_kind: str, out: str) -> None:
    from elastic_trainer.comm.algorithms import ALGORITHMS, get_algorithm
    from elastic_trainer.comm.compression import CODECS, make_codec
    from elastic_trainer.comm.stats import CommStats

    gpus = torch.cuda.device_count() if device_kind == "cuda" else 0
    nccl = gpus >= procs
    if device_kind == "cuda":
        torch.cuda.set_device(rank % gpus)
        device = torch.device("cuda", rank % gpus)
    else:
        device = torch.device("cpu")
    backend = "cpu:gloo,cuda:nccl" if nccl else "gloo"
    if device_kind == "cuda" and not nccl:
        import _gpu_transport
        _gpu_transport.install()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=procs,
                            timeout=timedelta(seconds=120))
    rows = {}
    names = [("codec", n) for n in CODECS] + [("algorithm", n) for n in ALGORITHMS]
    for kind, name in names:
        err, scale, comm_s, error = 0.0, 0.0, 0.0, None
        try:
            if kind == "codec":
                on_cpu, on_dev = make_codec(name, **OPTIONS.get(name, {})), make_codec(name, **OPTIONS.get(name, {}))
            for step in range(1, STEPS + 1):
                x = _inputs(rank, step)
                a, b = x.clone(), x.to(device)
                stats = CommStats()
                if kind == "codec":
                    on_cpu.average(a, None, CommStats(), bucket=0, shapes=SHAPES, step=step)
                    on_dev.average(b, None, stats, bucket=0, shapes=SHAPES, step=step)
                else:
                    get_algorithm(name)(a, None, CommStats())
                    get_algorithm(name)(b, None, stats)
                comm_s += stats.seconds
                err = max(err, float((b.cpu() - a).abs().max()))
                scale = max(scale, float(a.abs().max()))
        except Exception as e:  # noqa: BLE001 - reported in the table
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        rows[name] = {"kind": kind, "rel_err": err / scale if scale else err, "comm_s": comm_s, "error": error}
    # The worst rank is the figure.
    worst = torch.tensor([rows[n]["rel_err"] for _, n in names], dtype=torch.float64)
    failed = torch.tensor([1.0 if rows[n]["error"] else 0.0 for _, n in names], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if rank == 0:
        for (kind, n), w, f in zip(names, worst.tolist(), failed.tolist()):
            rows[n]["rel_err"] = w
            rows[n]["ok"] = not f and w <= TOLERANCE[n]
            rows[n]["tolerance"] = TOLERANCE[n]
        info = {"backend": backend + ("" if nccl or device_kind != "cuda" else " (host-staged ops)"),
                "device": device_kind, "procs": procs, "rows": rows}
        with open(out, "w") as f:
            json.dump(info, f)
    dist.destroy_process_group()


def run(out_path: str, device_kind: str, procs: int = 4) -> dict:
    """Run part 1 in ``procs`` fresh processes; returns its results."""
    port = free_port("127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_worker, args=(procs, port, device_kind, out_path), nprocs=procs, join=True,
                       start_method="spawn")
    with open(out_path) as f:
        return json.load(f)
