"""A worker ends with its node: once its raylet dies, the process exits at once.

Ray starts a worker as a child of its node's raylet. When the raylet dies (a
node killed, the raylet OOM-killed) its workers learn of it on their own only
after a second or two, and meanwhile they keep their sockets open: their
peers' collectives wait on them, and the controller sees a silent rank (the
heartbeat) rather than a death. A worker whose raylet is gone can store no
object and take no call, so nothing is lost by ending it at once: the kernel
closes its sockets, and every peer waiting on it fails within milliseconds,
as when the whole node goes.

The watch reads the parent's pid every ``interval_s``: it changes only when
the parent dies (the process is re-parented). Where the parent is not a
raylet (a worker not started by Ray's node manager) there is nothing to
watch.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def watch_raylet(name: str = "this worker", interval_s: float = 0.05, on_death=None,
                 parent_names=("raylet",)) -> threading.Thread | None:
    """Start the watch (a daemon thread); None where the parent is not one of ``parent_names``
    (None: any parent). ``on_death`` (default: SIGKILL this process) runs once it is gone.
    ``name`` heads its log line ("[run] worker N")."""
    parent = os.getppid()
    if parent_names is not None and _comm(parent) not in parent_names:
        return None
    stop = on_death or (lambda: os.kill(os.getpid(), signal.SIGKILL))

    def run() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        log.warning("%s: its raylet (pid %d) died: ending the worker now", name, parent)
        stop()

    t = threading.Thread(target=run, name="raylet-watch", daemon=True)
    t.start()
    return t
