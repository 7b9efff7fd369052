"""A rank blocked in a pipeline receive, its gradients' all-reduce or a collective on a group it
holds is read as waiting in that group, with one more operation issued on it than its idle peer;
once the peer answers, it is not.

Two real gloo processes on loopback, the real GradSync and torch's pipeline wait; no Ray.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from datetime import timedelta

import pytest

from elastic_trainer.controller.failures.stuck_steps import stuck
from elastic_trainer.worker.process_group import free_port
from elastic_trainer.worker.wait_site import waiting_in, where

# What each blocked rank is read as waiting in, and its innermost frame's function.
WANT = {"pp": "pp", "dp": "dp", "collective": "pp"}
WHERE = {"pp": "_wait_batch_p2p", "dp": "finish", "collective": "all_reduce"}


def _at(thread: threading.Thread) -> str | None:
    at = where(thread.ident)
    return at.split(":")[1] if at else None


def _read_until(thread: threading.Thread, function: str | None, role_of, issued=lambda: True,
                timeout_s: float = 10.0):
    """Once the thread's innermost frame is ``function`` (or it has ended, for None) and the
    operation is ``issued``: what it is read as waiting in, and that frame's function."""
    deadline = time.monotonic() + timeout_s
    while (_at(thread) != function or not issued()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return waiting_in(thread.ident, role_of), _at(thread)


def _rank(rank: int, port: int, kind: str, go, out) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    from elastic_trainer.comm.grad_sync import GradSync
    from elastic_trainer.comm.stats import CommStats
    from elastic_trainer.config import CommSection
    from elastic_trainer.worker.group_carry import sequence

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    group = dist.group.WORLD
    layer = torch.nn.Linear(4, 4)
    sync = GradSync(list(layer.named_parameters()), group, 2, CommSection(), accumulations=1)
    t = torch.zeros(8)
    # This world of two stands for the pipeline group a rank holds (GroupKeeper.role_of).
    role_of = lambda g: "pp" if g is group else None   # noqa: E731

    def blocked() -> None:
        if kind == "collective":
            dist.all_reduce(t, group=group)   # as the gradient norm's, over the pipeline
        elif kind == "pp":
            _wait_batch_p2p(dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 1 - rank, group)]))
        else:
            sync.begin_step(1)
            layer(torch.ones(2, 4)).sum().backward()   # the hooks hand the bucket to the comm thread
            sync.finish(CommStats())

    if rank == 0:
        go.wait(30)   # idle until rank 1 has been read, then the matching operation
        if kind == "pp":
            dist.send(torch.ones(8), 1, group)
        else:
            blocked()
        out.put({"rank": 0, "seq": sequence(group)})
    else:
        before = sequence(group)
        th = threading.Thread(target=blocked, daemon=True)
        th.start()
        waiting, at = _read_until(th, WHERE[kind], role_of, issued=lambda: sequence(group) > before)
        seq = sequence(group)
        go.set()
        th.join(20)
        out.put({"rank": 1, "waiting": waiting, "at": at, "seq_blocked": seq, "ended": not th.is_alive(),
                 "after": _read_until(th, None, role_of, timeout_s=1.0)[0]})
    out.close()
    out.join_thread()
    os._exit(0)


def _run(kind: str) -> dict:
    ctx = multiprocessing.get_context("fork")
    out, go = ctx.Queue(), ctx.Event()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank, args=(r, port, kind, go, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        return {m["rank"]: m for m in (out.get(timeout=60), out.get(timeout=60))}
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)


@pytest.mark.parametrize("kind", list(WANT))
def test_a_blocked_step_names_its_group_and_is_stuck_only_while_its_peer_is_idle(kind):
    got = _run(kind)
    blocked = got[1]
    assert blocked["waiting"] == WANT[kind] and blocked["ended"] and blocked["after"] is None, got
    assert blocked["at"] == WHERE[kind], got
    # While rank 1 waited, idle rank 0 had issued one operation fewer on the group: the
    # controller reads rank 1 as stuck, and not once rank 0 has issued it too.
    key, role = [0, 1], WANT[kind]
    seq_idle = got[0]["seq"] - 1   # rank 0's count before the one matching operation
    states = {1: {"busy": True, "waiting": role, "held": {role: [key, blocked["seq_blocked"]]}},
              0: {"busy": False, "waiting": None, "held": {role: [key, seq_idle]}}}
    assert stuck(states) == {1}, got
    states[0]["held"][role][1] = got[0]["seq"]
    assert stuck(states) == set(), got
