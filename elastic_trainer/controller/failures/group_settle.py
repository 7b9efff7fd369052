"""After a failure on gloo: which of the failed plan's groups are whole, to carry into the next.

Two rounds (``settle_groups``). The first cuts the groups a lost member was in:
never whole, and cutting them ends the collectives survivors wait in on each
other, so those ranks leave their steps too. Then the survivors' steps are
given up to ``failure.ping_timeout_s`` to end, no longer than while one could
still end by itself (``stuck_steps.stuck``). The second round keeps the groups
every member holds alike with no step running and cuts the rest, which ends
what any rank still waits in: on a peer that died, or on one that went silent
(a frozen node's sockets stay open, so only the cut ends a wait on it).
"""

from __future__ import annotations

import time

import ray

from ...parallel.topology import Topology
from ..run.group_carry import plan_keys, whole_groups
from ..stepping.one_step import StepOutcome
from .stuck_steps import stuck
from ..run.workers import WorkerPool
from ..run.asking import ask_all


# How often, while survivors' steps end after the first cut, to look whether those still in
# theirs can only be ended by a cut.
_STEP_END_POLL_S = 0.05


def settle_groups(pool: WorkerPool, topo: Topology, ranks: dict[int, int], out: StepOutcome,
                  timeout_s: float) -> tuple[set, dict]:
    """Settle the groups of the plan ``topo`` with ``ranks`` (rank -> worker id) after the failed
    step ``out``. Returns the whole groups' keys (``group_carry``), which every survivor keeps,
    and how the wait for the survivors' steps went (for the recovery event)."""
    keys = plan_keys(topo, ranks)
    survivors = {r: w for r, w in ranks.items() if w in pool}

    def settle(keep) -> None:
        ask_all({w: pool[w].actor.settle_groups.remote(keep(r)) for r, w in survivors.items()}, timeout_s)

    settle(lambda r: [role for role, m in keys[r].items() if all(w in pool for w in m)])
    waited = _await_steps_ending(pool, out, list(survivors.values()), timeout_s)
    # A rank still inside its step waits in a group, so none of its groups is whole.
    whole = whole_groups(pool.ask("group_state", list(survivors.values()), timeout_s))
    settle(lambda r: [role for role, m in keys[r].items() if (role, tuple(m)) in whole])
    return whole, waited


def _await_steps_ending(pool: WorkerPool, out: StepOutcome, survivors: list[int], timeout_s: float) -> dict:
    """Up to ``timeout_s`` for the survivors' steps to end after the first cut (a busy host can
    take most of a second: 0.25 s left one busy in CI), but no longer than while one of them
    could still end by itself: once each still in its step is blocked where only a cut ends
    it, the wait is over. How long it waited, why it stopped, and who was still in a step."""
    pending = {ref: w for ref, w in out.inflight.items() if w in pool}
    t0 = time.perf_counter()
    end = t0 + timeout_s
    why, states = "steps ended", {}
    while pending:
        left = end - time.perf_counter()
        if left <= 0:
            why = "timeout"
            break
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=min(_STEP_END_POLL_S, left))
        for ref in ready:
            pending.pop(ref)
        if pending:
            states = pool.ask("group_state", survivors, timeout_s)
            if set(pending.values()) <= stuck(states):
                why = "stuck"
                break
    # Where each step left running was, as last read: the group it waits in, or its innermost
    # frame where that is no wait ``worker.wait_site`` names (why a wait ran out).
    return {"settle_wait_s": round(time.perf_counter() - t0, 3), "settle_wait_end": why,
            "settle_left": {w: (states[w].get("waiting") or states[w].get("at")) if isinstance(states.get(w), dict)
                            else None for w in sorted(pending.values())}}
