"""Which process groups a re-plan carries over rather than builds (gloo, ``failure.keep_groups``).

A group is known by its key: its role (``dp`` or ``pp``) and the worker ids of
its members in group order. A new plan's group can be the last plan's when its
key is the same, and the old group is whole: every member holds it unbroken,
has issued the same number of operations on it, and runs no step (a member
still inside a step may be waiting in it, or about to issue more). Anything
else is built again; the workers cut the rest (``GroupKeeper.settle``).
"""

from __future__ import annotations

from ...parallel.topology import Topology

Key = tuple[str, tuple[int, ...]]


def carries_groups(cfg) -> bool:
    """Whether this run carries groups across re-plans: gloo with ``failure.keep_groups``."""
    return cfg.failure.keep_groups and cfg.scaling.resolved_backend() == "gloo"


def plan_keys(topo: Topology, ranks: dict[int, int]) -> dict[int, dict[str, list[int]]]:
    """rank -> role -> the worker ids of that rank's group, in group order."""
    out = {}
    for r in range(topo.world_size):
        replica, stage = topo.coords(r)
        out[r] = {"dp": [ranks[x] for x in topo.dp_group_ranks(stage)],
                  "pp": [ranks[x] for x in topo.pp_group_ranks(replica)]}
    return out


def whole_groups(states: dict[int, object]) -> set[Key]:
    """The keys of the groups that can be carried, from each worker's ``group_state`` answer
    (an exception for one that did not answer)."""
    seqs: dict[Key, dict[int, int]] = {}
    broken: set[Key] = set()
    for wid, state in states.items():
        if not isinstance(state, dict):
            continue
        for role, (members, seq) in state["held"].items():
            key = (role, tuple(members))
            seqs.setdefault(key, {})[wid] = seq
            if state["busy"]:
                broken.add(key)
    return {key for key, by in seqs.items()
            if key not in broken and set(by) == set(key[1]) and len(set(by.values())) == 1}


def keep_for(keys: dict[int, dict[str, list[int]]], whole: set[Key]) -> dict[int, list[str]]:
    """rank -> the roles whose group the rank carries into the plan of ``keys``."""
    return {r: [role for role, members in by_role.items() if (role, tuple(members)) in whole]
            for r, by_role in keys.items()}


def count_groups(keys: dict[int, dict[str, list[int]]], keep: dict[int, list[str]]) -> dict[str, int]:
    """How many of the plan's distinct groups are carried, and how many built."""
    every = {(role, tuple(m)) for by_role in keys.values() for role, m in by_role.items()}
    kept = {(role, tuple(keys[r][role])) for r, roles in keep.items() for role in roles}
    return {"groups_carried": len(kept), "groups_built": len(every - kept)}


def sticky_ranks(topo: Topology, old_topo: Topology | None, old_ranks: dict[int, int],
                 usable: list[int], node_of: dict[int, str] | None = None) -> dict[int, int] | None:
    """Ranks for the survivors that keep what they can of the last plan: where the layout is the
    same, each surviving worker keeps its rank (its groups and blocks stay where they were);
    where only the number of replicas changed, each replica whose every stage survived stays a
    replica, its stages in order (its pipeline group is carried). The ranks left go to the
    other usable workers, grouped by node (``node_of``). None where the stages changed, or
    nothing of the last plan survives whole."""
    if old_topo is None or old_topo.pp != topo.pp or len(usable) < topo.world_size:
        return None
    alive = set(usable)
    if old_topo.dp == topo.dp:
        kept = {r: w for r, w in old_ranks.items() if w in alive}
    else:
        whole = [[old_ranks[old_topo.rank(rep, s)] for s in range(topo.pp)] for rep in range(old_topo.dp)]
        whole = [ws for ws in whole if all(w in alive for w in ws)][:topo.dp]
        kept = {topo.rank(rep, s): w for rep, ws in enumerate(whole) for s, w in enumerate(ws)}
    if not kept:
        return None
    rest = sorted((w for w in usable if w not in kept.values()), key=lambda w: ((node_of or {}).get(w, ""), w))
    spare = iter(rest)
    return {r: kept[r] if r in kept else next(spare) for r in range(topo.world_size)}
