"""Both top-k exchanges on the demo GPT's gradients at dp = 2, 4, 8: bytes per rank and seconds per step.

Each dp runs that many local gloo processes (one thread each); every process
averages the same-sized gradient bucket (the demo GPT's 875,264 parameters,
one bucket, as a step with one bucket would) with ``topk`` at ``ratio`` by
``allgather`` and by ``sparse_reduce``, ``iters`` times after one warm-up
call. Reported per exchange and dp: the bytes the busiest rank counted, and
the median over calls of the slowest rank's seconds (a collective ends for
everyone when the last rank is done). With more processes than cores the
seconds include waiting for a core, for both exchanges alike.

Used by ``benchmarks/comm.py --only-topk``.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time

NUMEL = 875_264


def _worker(rank: int, world: int, port: int, out_dir: str, ratio: float, iters: int) -> None:
    import torch
    import torch.distributed as dist

    from elastic_trainer.comm.compression import make_codec
    from elastic_trainer.comm.stats import CommStats

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        out = {}
        gen = torch.Generator().manual_seed(rank)
        for exchange in ("allgather", "sparse_reduce"):
            codec = make_codec("topk", ratio=ratio, exchange=exchange)
            times, sent = [], 0
            for i in range(iters + 1):
                grads = torch.randn(NUMEL, generator=gen)
                stats = CommStats()
                dist.barrier()
                t0 = time.perf_counter()
                codec.average(grads, None, stats)
                if i:
                    times.append(time.perf_counter() - t0)
                    sent = stats.bytes
            out[exchange] = {"bytes": sent, "seconds": times}
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def measure(worlds=(2, 4, 8), ratio: float = 0.01, iters: int = 10) -> list[dict]:
    import torch.multiprocessing as mp

    from elastic_trainer.worker.process_group import free_port

    rows = []
    for world in worlds:
        with tempfile.TemporaryDirectory() as out_dir:
            mp.start_processes(_worker, args=(world, free_port("127.0.0.1"), out_dir, ratio, iters), nprocs=world,
                               start_method="spawn")
            ranks = []
            for r in range(world):
                with open(os.path.join(out_dir, f"{r}.json")) as f:
                    ranks.append(json.load(f))
        for exchange in ("allgather", "sparse_reduce"):
            per_call = [max(r[exchange]["seconds"][i] for r in ranks) for i in range(iters)]
            rows.append({"dp": world, "exchange": exchange, "ratio": ratio, "numel": NUMEL,
                         "bytes_per_rank": max(r[exchange]["bytes"] for r in ranks),
                         "seconds_median": statistics.median(per_call),
                         "seconds_spread": [min(per_call), max(per_call)]})
    return rows


def print_rows(rows: list[dict]) -> None:
    print("\n| dp | exchange | bytes per rank | vs all-gather | s per step (median, min-max) |")
    print("|---|---|---|---|---|")
    gather = {r["dp"]: r["bytes_per_rank"] for r in rows if r["exchange"] == "allgather"}
    for r in rows:
        lo, hi = r["seconds_spread"]
        print(f"| {r['dp']} | {r['exchange']} | {r['bytes_per_rank'] / 1e3:,.1f} kB | "
              f"{r['bytes_per_rank'] / gather[r['dp']]:.2f}x | {r['seconds_median'] * 1e3:.1f} ms "
              f"({lo * 1e3:.1f}-{hi * 1e3:.1f}) |")
