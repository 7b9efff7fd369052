"""A worker ends once its parent (its node's raylet) dies: a real parent process is killed."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from elastic_trainer.worker.node_fate import watch_raylet

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")


def _child(out) -> None:
    t0 = []

    def died() -> None:
        out.put(("ended", os.getppid()))
        out.close()
        out.join_thread()
        os._exit(0)

    assert watch_raylet("test", interval_s=0.02, on_death=died, parent_names=None) is not None
    out.put(("watching", os.getpid()))
    time.sleep(30)
    out.put(("still running", t0))


def _parent(out) -> None:
    p = multiprocessing.get_context("fork").Process(target=_child, args=(out,))
    p.start()
    time.sleep(30)


def test_the_watch_ends_a_worker_whose_parent_died_at_once():
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    parent = ctx.Process(target=_parent, args=(out,))
    parent.start()
    what, child = out.get(timeout=20)
    assert what == "watching"
    os.kill(parent.pid, signal.SIGKILL)
    parent.join(5)
    # The watch ended the child (it would otherwise say "still running" 30 s on), and it did so
    # once its parent was gone: by then it had been given another. How soon is the watch's
    # interval, not a test's figure.
    what, ppid = out.get(timeout=20)
    assert what == "ended" and ppid != parent.pid
    try:
        os.kill(child, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_nothing_is_watched_under_a_parent_that_is_no_raylet():
    assert watch_raylet() is None   # pytest's parent is a shell or a runner, not a raylet
