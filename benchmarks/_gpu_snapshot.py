"""GPU check, part 3: the snapshot's device-to-host path against a plain pinned copy of the same bytes.

A stage's state on the GPU (parameters in blocks like a transformer's, and
AdamW's two moments after one step) is taken by the product's own
``SnapshotTaker``: on a side stream behind an event, tensor by tensor into
reused pinned flat buffers, while the caller goes on. The figure is the
bytes over the time from ``begin`` to the copy being there, the median of
``repeats`` after one warm-up (which allocates the pinned buffers). The
baseline is one ``copy_(non_blocking=True)`` of a contiguous device buffer of
the same size into pinned memory: what the link itself gives. Target: at
least 80% of it.
"""

from __future__ import annotations

import statistics
import time

import torch


def _state(gb: float, device: torch.device):
    """(named parameters, optimizer) holding about ``gb`` GB with AdamW's moments (3 x params)."""
    d = 2048
    per_block = 4 * d * d + 2 * d   # four d x d matrices and two norms, fp32
    blocks = max(1, int(gb * 1e9 / 3 / (per_block * 4)))
    named = []
    for b in range(blocks):
        for j in range(4):
            named.append((f"blocks.{b}.w{j}", torch.nn.Parameter(torch.randn(d, d, device=device))))
        for j in range(2):
            named.append((f"blocks.{b}.norm{j}", torch.nn.Parameter(torch.ones(d, device=device))))
    opt = torch.optim.AdamW([p for _, p in named], lr=1e-4)
    for _, p in named:
        p.grad = torch.zeros_like(p)
    opt.step()
    return named, opt, blocks


def run(gb: float = 4.0, repeats: int = 3) -> dict:
    from elastic_trainer.worker.snapshot_taker import SnapshotTaker

    device = torch.device("cuda", torch.cuda.current_device())
    named, opt, blocks = _state(gb, device)
    nbytes = sum(p.nbytes + sum(v.nbytes for v in opt.state[p].values() if torch.is_tensor(v)) for _, p in named)
    taker = SnapshotTaker(device, wait_timeout_s=600)
    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        job = taker.begin(i, False, named, opt, list(range(blocks)), {}, {}, {})
        shard = job.copied(600)
        dt = time.perf_counter() - t0
        taker.wait()
        if i:
            times.append(dt)
        del shard, job   # its buffers are free for the next snapshot
    taker.close()
    # The same bytes in one contiguous buffer, one pinned copy.
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    plain = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        if i:
            plain.append(time.perf_counter() - t0)
    snap_gbs = nbytes / statistics.median(times) / 1e9
    plain_gbs = nbytes / statistics.median(plain) / 1e9
    return {"bytes": nbytes, "tensors": len(named) * 3, "snapshot_gbs": snap_gbs, "pinned_gbs": plain_gbs,
            "snapshot_spread_gbs": [nbytes / t / 1e9 for t in times], "ratio": snap_gbs / plain_gbs,
            "ok": snap_gbs >= 0.8 * plain_gbs}
