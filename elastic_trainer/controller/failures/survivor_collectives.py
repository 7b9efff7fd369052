"""After a failure: the survivors end the collectives they wait in, and the next plan may keep their world.

On gloo a survivor's collective fails by itself once its peer's process is
gone, so nothing is sent; where a peer went silent instead (no heartbeat: its
node froze, its sockets stay open), every survivor is told to cut its groups'
sockets (``worker.group_sockets``), which ends its collective at once; where
the run carries groups across re-plans, the recovery's settle round cuts just
the groups a lost member was in instead (``group_settle``). On NCCL it would wait on the GPU for good, so every
survivor is told to end it (``TrainWorker.abort_comms``). Where the backend
can shrink a communicator, the survivors drop the lost ranks in place: the
replicas that lost a rank leave whole (their live ranks abort and become
spares), and the rest keep their order, so rank ``replica * pp + stage``
becomes the same stage in the replica below. If the next plan is exactly
that, ``dp - k`` replicas with the same stages, every rank keeps its world
and its blocks, and the set-up builds subgroups only (no rendezvous).
Anything else falls back to abort and a new rendezvous.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ...parallel.topology import Topology
from ...planning.plan import Plan
from ...worker.group_failure import abort_needed
from ..run.workers import WorkerPool

log = logging.getLogger(__name__)


@dataclass
class ShrunkWorld:
    """The world the survivors shrank to: ``ranks`` maps worker id -> its rank there."""

    id: int
    ranks: dict[int, int]
    pp: int
    stage_bounds: list


def exclusion(topo: Topology, ranks: dict[int, int], lost_ranks: list[int]) -> tuple[list[int], list[int]]:
    """(ranks a shrink drops: every rank of a replica that lost one, workers that are alive but
    dropped with them). ``ranks``: rank -> worker id of the failed plan."""
    replicas = {topo.coords(r)[0] for r in lost_ranks}
    dropped = sorted(r for r in ranks if topo.coords(r)[0] in replicas)
    spares = [ranks[r] for r in dropped if r not in lost_ranks]
    return dropped, spares


def end_collectives(pool: WorkerPool, backend: str, topo: Topology | None, ranks: dict[int, int],
                    lost: list[int], plan_bounds: list | None, shrink_id: int, timeout_s: float,
                    silent: bool = False) -> ShrunkWorld | None:
    """Tell the survivors of the failed plan to end their collectives (see the module docstring).
    ``lost``: ranks of the lost workers; ``silent``: one of them went silent rather than died.
    Returns the shrunk world where every survivor kept one consistently, else None. Without a
    lost rank (a step raised, a collective failed with every worker alive) every survivor aborts."""
    if topo is None:
        return None
    survivors = {w: r for r, w in ranks.items() if w in pool}
    if not abort_needed(backend):
        if silent:
            # A control call that answers at once: no rendezvous timeout to wait out.
            pool.ask("abort_comms", list(survivors), min(timeout_s, 5.0), [], None, timeout_s)
        return None
    dropped, spares = exclusion(topo, ranks, lost)
    # Rank 0 hosts the world's store, which a shrink opens anew: without it, no shrink.
    keep = [w for w, r in survivors.items() if r not in dropped] if lost and 0 not in dropped else []
    answers = pool.ask("abort_comms", [w for w in survivors if w not in keep], timeout_s, [], None, timeout_s)
    if keep:
        answers.update(pool.ask("abort_comms", keep, timeout_s + 5.0, dropped, shrink_id, timeout_s))
    kept = {w: a.get("rank") for w, a in answers.items() if isinstance(a, dict) and a.get("shrunk")}
    if not kept or sorted(kept) != sorted(keep) or sorted(kept.values()) != list(range(len(keep))):
        if kept:
            log.warning("survivors %s shrank, %s did not: the next plan joins by rendezvous",
                        sorted(kept), sorted(set(keep) - set(kept)))
        return None
    return ShrunkWorld(shrink_id, kept, topo.pp, list(plan_bounds or []))


def shrunk_ranks(shrunk: ShrunkWorld | None, plan: Plan, alive) -> dict[int, int] | None:
    """rank -> worker id of ``plan`` in the shrunk world, where ``plan`` is that world as it is
    (its size, its pp, its stage bounds) and every worker of it is still ``alive``; else None."""
    if shrunk is None or not all(w in alive for w in shrunk.ranks):
        return None
    topo = plan.topology
    if (topo.world_size != len(shrunk.ranks) or topo.pp != shrunk.pp
            or [tuple(b) for b in plan.stage_bounds] != [tuple(b) for b in shrunk.stage_bounds]):
        return None
    return {r: w for w, r in shrunk.ranks.items()}
