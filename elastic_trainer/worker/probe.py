"""How fast a benched worker computes now: a fixed workload on its device, timed by its clock.

A straggler left out as a spare (``controller.benching``) runs no steps, so
its pace can no longer be read from them. Instead the controller asks it,
every ``balance.window`` steps, to run the same small workload (a chain of
matrix products, the kind of arithmetic a step is made of) and compares the
time with the one it took when it was benched: a worker that was P times
slower than its peers has recovered once its probe runs about P times
faster than it did then.

The workload is timed ``REPEATS`` times and the fastest is kept: on a host
whose cores other workers share, interference only ever adds time.
"""

from __future__ import annotations

import time

import torch

from ..comm.timing import start_timer

SIZE = 256      # the matrices' side: about 34 MFLOP a product, a few ms in all on a CPU core
PRODUCTS = 32
REPEATS = 3


def probe_compute(device: torch.device, slow_factor: float = 1.0) -> float:
    """Seconds the fixed workload takes on ``device`` (the fastest of ``REPEATS``), times
    ``slow_factor`` (the straggler hook, as ``ComputeClock`` applies it)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(SIZE, SIZE, generator=gen).to(device)
    b = torch.randn(SIZE, SIZE, generator=gen).to(device) / SIZE ** 0.5
    best = float("inf")
    for _ in range(REPEATS):
        timer = start_timer(device)
        t0 = time.perf_counter()
        x = a
        for _ in range(PRODUCTS):
            x = x @ b
        float(x[0, 0])  # the products have run (a CUDA timer reads its events; this also syncs)
        if slow_factor > 1.0:
            time.sleep((slow_factor - 1.0) * (time.perf_counter() - t0))
        best = min(best, timer.stop().seconds())
    return best
