"""A gloo collective whose peer froze (SIGSTOP: its sockets stay open) ends once the groups' sockets are cut.

Two real processes on loopback; no Ray.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import struct
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


def _proc_net_address(addr) -> str:
    """``(host, port)`` as /proc/net/tcp{,6} write a socket's address."""
    host, port = addr[:2]
    if ":" in host:
        words = struct.unpack("=4I", socket.inet_pton(socket.AF_INET6, host))
        return "".join(f"{w:08X}" for w in words) + f":{port:04X}"
    return f"{struct.unpack('=I', socket.inet_aton(host))[0]:08X}:{port:04X}"


def _unread(addresses) -> int:
    """Bytes the sockets at ``addresses`` have received and their process has not read."""
    want = {_proc_net_address(a) for a in addresses}
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[1] in want:
                    total += int(fields[4].split(":")[1], 16)   # tx_queue:rx_queue
    return total


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] in ("T", "t")


def _freeze(sockets: GroupSockets, peer) -> None:
    """Rank 1: tell rank 0 where its sockets are, and stop (alive, its sockets open, answering nothing)."""
    peer.put((os.getpid(), sockets.addresses()))
    peer.close()
    peer.join_thread()
    os.kill(os.getpid(), signal.SIGSTOP)


def _collective_on_frozen_peer(t, peer, box: dict, wait_s: float = 30.0) -> tuple[threading.Thread, int, bool]:
    """Rank 0: once rank 1 is stopped, an all-reduce on a thread; returns when it has sent its
    part into the frozen peer's sockets (bytes there unread), so that it waits on the answer:
    (the thread, the peer's pid, whether it was waiting so). The event itself, not a guess at
    how long the thread takes to get there."""
    import torch.distributed as dist

    pid, addresses = peer.get(timeout=wait_s)
    deadline = time.monotonic() + wait_s
    while not _stopped(pid) and time.monotonic() < deadline:
        time.sleep(0.005)
    before = _unread(addresses)

    def step() -> None:
        try:
            dist.all_reduce(t)
            box["ended"] = ("returned", time.perf_counter())
        except RuntimeError as e:
            box["ended"] = (str(e), time.perf_counter())

    th = threading.Thread(target=step, daemon=True)
    th.start()
    while _unread(addresses) <= before and th.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    return th, pid, th.is_alive() and _unread(addresses) > before


def _rank(rank: int, port: int, cut: bool, peer, out) -> None:
    sockets, t = _joined(rank, port)
    if rank == 1:
        _freeze(sockets, peer)
        return
    box: dict = {}
    th, _, waiting = _collective_on_frozen_peer(t, peer, box)
    held = sockets.held()
    cut_at = time.perf_counter()
    n_cut = sockets.cut() if cut else 0
    # Cut: a generous deadline for the end it causes. Not cut: still waiting 3 s on is the point.
    th.join(20.0 if cut else 3.0)
    ended = box.get("ended")
    out.put({"held": held, "cut": n_cut, "waiting": waiting, "fds_left": len(socket_fds()),
             "ended": None if ended is None else (ended[0], ended[1] >= cut_at)})
    out.close()
    out.join_thread()
    os._exit(0)   # the groups still hold the (shut) fds; nothing to tear down


def _run(cut: bool) -> dict:
    ctx = multiprocessing.get_context("fork")
    out, peer = ctx.Queue(), ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank, args=(r, port, cut, peer, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=90)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)


def test_a_collective_waiting_on_a_frozen_peer_ends_once_its_sockets_are_cut():
    got = _run(cut=True)
    assert got["waiting"] and got["held"] >= 2 and got["cut"] >= 1, got   # the store's and the group's connections
    message, after_cut = got["ended"]
    # Ended by the cut, after it (its own timeout is 30 s). How soon is no test's figure.
    assert "closed" in message.lower() and after_cut, got


def test_without_the_cut_it_waits_on():
    got = _run(cut=False)
    assert got["waiting"] and got["ended"] is None, got   # still waiting 3 s on (its timeout is 30 s)


def _killed_peer(rank: int, port: int, peer, out) -> None:
    sockets, t = _joined(rank, port)
    if rank == 1:
        out.put({"rank": 1, "addresses": sockets.addresses()})
        out.close()
        out.join_thread()
        _freeze(sockets, peer)
        return
    # Rank 1 dies (its sockets close with it) while rank 0's all-reduce waits on it.
    box: dict = {}
    th, pid, waiting = _collective_on_frozen_peer(t, peer, box)
    os.kill(pid, signal.SIGKILL)
    th.join(20.0)
    out.put({"rank": 0, "waiting": waiting, "error": box.get("ended", ("still waiting",))[0]})
    out.close()
    out.join_thread()
    os._exit(0)


def test_the_survivors_error_names_an_address_the_killed_peer_reported():
    from elastic_trainer.controller.stepping.one_step import StepDriver

    ctx = multiprocessing.get_context("fork")
    out, peer = ctx.Queue(), ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_killed_peer, args=(r, port, peer, out)) for r in (0, 1)]
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
    assert got[0]["waiting"], got[0]
    assert got[1]["addresses"] and driver._named(RuntimeError(got[0]["error"])) == [7], (got[1], got[0]["error"][:400])
