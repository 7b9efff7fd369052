"""A worker asking other nodes the controller's heartbeat question, for a fleet too large for
the controller to ask each node itself (``controller.heartbeat``, ``failure.heartbeat_fanout``).

The relay sends each node's question at once and answers after the first of
all of them answering or ``wait_s``: a node that has not answered by then is
reported as unheard (None), and the controller asks it again next round
through another relay. The relay answering says nothing of the nodes it
asked; only their own answers do.
"""

from __future__ import annotations

from collections.abc import Callable

import ray


def relay_pings(asks: dict[int, tuple[object, dict]], wait_s: float, me: int,
                local: Callable[[dict], dict]) -> dict[int, dict | None]:
    """Worker asked -> its node's answer (``TrainWorker.ping_node``), or None where none came
    within ``wait_s``. ``asks``: worker asked -> (its actor handle, its node-mates' processes);
    ``me``: this worker's id, answered by ``local`` (a call to itself could wait behind this one)."""
    out: dict[int, dict | None] = {}
    refs = {}
    for who, (handle, mates) in asks.items():
        if who == me:
            out[who] = local(mates)
        else:
            refs[handle.ping_node.remote(mates)] = who
    if refs:
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
        for ref in ready:
            try:
                out[refs[ref]] = ray.get(ref)
            except Exception:  # noqa: BLE001 - its process is gone: unheard, as a frozen one
                pass
    return {who: out.get(who) for who in asks}
