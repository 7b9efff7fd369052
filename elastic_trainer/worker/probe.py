"""How fast a benched worker computes now: a fixed workload on its device, timed by its clock.

A straggler left out as a spare (``controller.benching``) runs no steps, so
its pace can no longer be read from them. Instead the controller asks it,
every ``balance.window`` steps, to run the same small workload (a chain of
matrix products, the kind of arithmetic a step is made of) and compares the
time with the one it took when it was benched: a worker that was P times
slower than its peers has recovered once its probe runs about P times
faster than it did then.

The workload is timed ``REPEATS`` times and the fastest is kept: on a host
whose cores other workers share, interference only ever adds time. Its size
is fixed at the first probe of a benched worker: the number of products is
doubled until one repeat takes ``MIN_SECONDS`` (a GPU does 32 of them in
microseconds, too short to time), and later probes reuse that number, so
their times compare.
"""

from __future__ import annotations

import time

import torch

from ..comm.timing import start_timer

SIZE = 256      # the matrices' side: about 34 MFLOP a product
FIRST_PRODUCTS = 8
MAX_PRODUCTS = 1 << 16
MIN_SECONDS = 0.02
REPEATS = 3


def _time(a: torch.Tensor, b: torch.Tensor, products: int, device: torch.device, slow_factor: float) -> float:
    timer = start_timer(device)
    t0 = time.perf_counter()
    x = a
    for _ in range(products):
        x = x @ b
    float(x[0, 0])  # the products have run (a CUDA timer reads its events; this also syncs)
    if slow_factor > 1.0:
        time.sleep((slow_factor - 1.0) * (time.perf_counter() - t0))
    return timer.stop().seconds()


def probe_compute(device: torch.device, slow_factor: float = 1.0, products: int | None = None) -> tuple[float, int]:
    """(seconds the workload takes on ``device``, the fastest of ``REPEATS``; its number of
    products). ``products`` None sizes it (see the module docstring). ``slow_factor``: the
    straggler hook, as ``ComputeClock`` applies it."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(SIZE, SIZE, generator=gen).to(device)
    b = torch.randn(SIZE, SIZE, generator=gen).to(device) / SIZE ** 0.5
    if products is None:
        products = FIRST_PRODUCTS
        while products < MAX_PRODUCTS and _time(a, b, products, device, 1.0) < MIN_SECONDS:
            products *= 2
    return min(_time(a, b, products, device, slow_factor) for _ in range(REPEATS)), products
