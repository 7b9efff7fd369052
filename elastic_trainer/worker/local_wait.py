"""Waiting for objects to be local without stalling the worker's other threads.

A blocking ``ray.get`` of an object not yet on this node holds the process's
plasma client lock while it waits, in slices of up to a second, until the
object arrives or Ray declares it lost. Every other thread of the worker that
touches the object store waits behind it: a restore read it serves (its
return is written into the store), its own restore's reads, a snapshot part
it returns. A pin of a part whose node had just died held the lock so for
seconds, and a recovery that needed the pinning worker waited with it (the
sharded recoveries' tail in ``docs/performance.md``). So an object that may
not be local is polled with ``ray.wait(timeout=0)``, which starts its pull and
answers at once, and is got only when it is here (or failed: then the get
raises at once).
"""

from __future__ import annotations

import time
from typing import Callable

import ray

POLL_S = 0.01


def wait_local(refs: list, aborted: Callable[[], bool] | None = None, on_ready: Callable[[], None] | None = None,
               poll_s: float = POLL_S) -> bool:
    """Until every object of ``refs`` is in this node's store (or has failed). ``aborted``: asked
    between polls; True ends the wait early, and this returns False. ``on_ready``: called once
    per object as it arrives."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0, fetch_local=True)
        for _ in ready:
            if on_ready is not None:
                on_ready()
        if not pending:
            break
        if aborted is not None and aborted():
            return False
        time.sleep(poll_s)
    return True
