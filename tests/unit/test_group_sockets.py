"""A gloo collective whose peer froze (SIGSTOP: its sockets stay open) ends once the groups' sockets are cut.

Two real processes on loopback; no Ray.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from datetime import timedelta

import pytest

from elastic_trainer.worker.group_sockets import GroupSockets, socket_fds
from elastic_trainer.worker.process_group import free_port

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd (Linux)")


def _joined(rank: int, port: int):
    """Join a 2-rank gloo world on loopback and run one all-reduce: its sockets, and the tensor."""
    import torch
    import torch.distributed as dist

    sockets = GroupSockets()
    with sockets.opened_during():
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    t = torch.ones(64)
    dist.all_reduce(t)
    return sockets, t


def _rank(rank: int, port: int, cut_after_s: float | None, out) -> None:
    import torch.distributed as dist

    sockets, t = _joined(rank, port)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)   # frozen: alive, its sockets open, answering nothing
        return
    box: dict = {}

    def step() -> None:
        t0 = time.perf_counter()
        try:
            dist.all_reduce(t)
            box["ended"] = ("returned", time.perf_counter() - t0)
        except RuntimeError as e:
            box["ended"] = (str(e), time.perf_counter() - t0)

    th = threading.Thread(target=step, daemon=True)
    th.start()
    time.sleep(0.5)
    held = sockets.held()
    cut = sockets.cut() if cut_after_s is not None else 0
    th.join(3.0)
    out.put({"held": held, "cut": cut, "ended": box.get("ended"), "fds_left": len(socket_fds())})
    out.close()
    out.join_thread()
    os._exit(0)   # the groups still hold the (shut) fds; nothing to tear down


def _run(cut: bool) -> dict:
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank, args=(r, port, 0.5 if cut else None, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)


def test_a_collective_waiting_on_a_frozen_peer_ends_once_its_sockets_are_cut():
    got = _run(cut=True)
    assert got["held"] >= 2 and got["cut"] >= 1, got   # the store's and the group's connections
    message, seconds = got["ended"]
    assert "closed" in message.lower() and seconds < 2.0, got


def test_without_the_cut_it_waits_on():
    got = _run(cut=False)
    assert got["ended"] is None, got   # still waiting 3 s on (its timeout is 30 s)


def _killed_peer(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    sockets, t = _joined(rank, port)
    if rank == 1:
        out.put({"rank": 1, "addresses": sockets.addresses()})
        out.close()
        out.join_thread()
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)   # its sockets close with it
    try:
        dist.all_reduce(t)
        message = "returned"
    except RuntimeError as e:
        message = str(e)
    out.put({"rank": 0, "error": message})
    out.close()
    out.join_thread()
    os._exit(0)


def test_the_survivors_error_names_an_address_the_killed_peer_reported():
    from elastic_trainer.controller.stepping import StepDriver

    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_killed_peer, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = {m["rank"]: m for m in (out.get(timeout=60), out.get(timeout=60))}
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)
    # The controller maps each reported address to its worker (here worker 7) and reads the
    # survivor's error for them (StepDriver._named).
    driver = StepDriver.__new__(StepDriver)
    driver.set_peers({7: got[1]["addresses"]})
    assert got[1]["addresses"] and driver._named(RuntimeError(got[0]["error"])) == [7], (got[1], got[0]["error"][:400])
