"""Resident memory of a rank, step by step, with its optimizer sharded or whole: two gloo processes
(dp=2 x pp=1) run ``StageTrainer`` on a GPT of 4 layers x 640 (20 M parameters), no Ray.

Per mode: VmRSS and VmHWM (MB) after the build and after each step, each step's seconds, and the
optimizer state's bytes from the tensors. ``--allocator`` starts the ranks on jemalloc as Ray
workers are by default (``scaling.cpu_allocator``, ``worker.allocator``) or on glibc's malloc;
under glibc, ``glibc in use / free`` is ``mallinfo2``'s bytes allocated and freed-but-kept.
``--trim`` calls glibc's ``malloc_trim(0)`` after each step: what the allocator keeps apart
from what is live.

    python benchmarks/shard_memory.py                    # none, gradients; 8 steps; jemalloc
    python benchmarks/shard_memory.py --allocator system --steps 16
    python benchmarks/shard_memory.py --allocator system --trim
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss() -> tuple[int, int]:
    got = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS", "VmHWM")):
            got[line[:5]] = int(line.split()[1]) // 1024
    return got["VmRSS"], got["VmHWM"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _glibc_mb(libc) -> str:
    """glibc's bytes in use (heap and mmapped) and freed but kept, in MB; blank under jemalloc."""
    from elastic_trainer.worker.allocator import in_use

    if in_use() != "system" or not hasattr(libc, "mallinfo2"):
        return ""
    libc.mallinfo2.restype = _MallInfo2
    mi = libc.mallinfo2()
    return f"{(mi.uordblks + mi.hblkhd) >> 20} / {mi.fordblks >> 20}"


def _rank(rank, port, shard, corpus, steps, trim, q):
    import time

    import torch

    torch.set_num_threads(1)   # as a Ray worker of one CPU runs
    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.parallel.topology import Topology
    from elastic_trainer.worker.process_group import destroy_groups, init_groups
    from elastic_trainer.worker.stage import StageTrainer

    libc = ctypes.CDLL("libc.so.6")
    cfg = TrainerConfig.from_dict({
        "data": {"path": corpus, "seq_len": 64, "prepare": "stdlib"},
        "model": {"kind": "gpt", "n_layer": 4, "n_head": 4, "d_model": 640},
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "steps": steps},
        "parallel": {"dp": 2, "pp": 1, "shard_optimizer": shard}, "run": {"output_dir": None}})
    topo = Topology(2, 1)
    groups = init_groups("gloo", "127.0.0.1", port, topo, rank, timeout_s=60)
    t = StageTrainer(cfg, topo, rank, groups, [(0, 6)], torch.device("cpu"))
    marks = [("built", _rss(), 0.0, _glibc_mb(libc))]
    for s in range(1, steps + 1):
        t0 = time.perf_counter()
        t.train_step(s)
        if trim:
            libc.malloc_trim(0)
        marks.append((f"step {s}", _rss(), time.perf_counter() - t0, _glibc_mb(libc)))
    state = sum(v.numel() * v.element_size() for st in t.optimizer.state.values() for v in st.values()
                if torch.is_tensor(v))
    q.put((rank, "ok", (marks, state)))
    t.close()
    destroy_groups()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="none,gradients")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--allocator", choices=["jemalloc", "system"], default="jemalloc",
                    help="the ranks' malloc, as scaling.cpu_allocator sets a Ray worker's")
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) after each step (glibc)")
    args = ap.parse_args()
    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.data.dataset import ensure_prepared
    from elastic_trainer.worker.allocator import allocator_env
    from tests.helpers import spawn_ranks

    # The ranks are fresh interpreters: they start with what this process's environment says.
    env = allocator_env(args.allocator, uses_gpu=False)
    if args.allocator == "jemalloc" and not env:
        raise SystemExit("--allocator jemalloc: this Ray ships no libjemalloc.so (not Linux?)")
    os.environ.update(env)
    corpus = os.path.abspath(os.path.expanduser("~/.cache/elastic_trainer/stdlib-corpus-64"))
    ensure_prepared(TrainerConfig.from_dict({"data": {"path": corpus, "seq_len": 64, "prepare": "stdlib"}}).data)
    for mode in args.modes.split(","):
        got = spawn_ranks(_rank, 2, mode, corpus, args.steps, args.trim)
        status, (marks, state) = got[0]
        print(f"\n{mode} on {args.allocator}{' (malloc_trim after each step)' if args.trim else ''}: "
              f"optimizer state {state / 1e6:.0f} MB on rank 0")
        print("| after | RSS MB | peak MB | step s | glibc in use / free MB |")
        print("|---|---|---|---|---|")
        for what, (rss, hwm), secs, glibc in marks:
            print(f"| {what} | {rss} | {hwm} | {secs:.3f} | {glibc} |")


if __name__ == "__main__":
    main()
