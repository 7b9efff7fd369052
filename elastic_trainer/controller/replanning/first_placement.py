"""Where a run's first workers go: every worker of its plan where the cluster has room for them
soon, else the workers that fit, at least ``scaling.min_workers``, on the layout the re-plan
policy picks for them.

A cluster one node short at the start (a node still booting, a preempted one
not yet replaced, a resume on fewer machines) used to hold the start for
``scaling.placement_timeout_s`` and then fail. Mid-run the same loss re-plans
down; at the start it now does the same after ``scaling.start_wait_s``, and the
grow check takes in the nodes that join later (up to ``scaling.max_workers``),
as Ray Train's elastic ``num_workers=(min, max)`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config import TrainerConfig
from ...errors import PlacementError
from ...planning.plan import Plan, plan_for
from ...planning.policy import check_start, choose_plan, memory_bound, no_plan_reason
from ..run.placement import find_nodes, pick_nodes


@dataclass
class FirstPlacement:
    plan: Plan
    nodes: list[str]            # a node per rank
    smaller: dict | None = None  # where the plan is not the configured one: the start_smaller event's fields


def place_first(cfg: TrainerConfig, plan: Plan, counts: list[int]) -> FirstPlacement:
    """Nodes for ``plan``'s workers, waiting up to ``scaling.start_wait_s``; past it, the plan the
    re-plan policy picks for the workers that fit (at least ``scaling.min_workers``, waited for
    up to ``scaling.placement_timeout_s`` in all). Raises :class:`PlacementError` naming the
    room there was and the least that would do."""
    scaling = cfg.scaling
    want = plan.topology.world_size
    first_wait = min(scaling.start_wait_s, scaling.placement_timeout_s)
    least = max(1, scaling.min_workers)
    left = max(0.0, scaling.placement_timeout_s - first_wait)
    try:
        return FirstPlacement(plan, find_nodes(scaling, want, {}, first_wait))
    except PlacementError as full:
        if least >= want:
            raise
        try:
            find_nodes(scaling, least, {}, left)   # room for the least the run may start on
        except PlacementError:
            raise PlacementError(f"{full} Starting on fewer needs room for scaling.min_workers({least}) "
                                 f"workers; there was room for {len(pick_nodes(scaling, want, {}))}.") from None
    room = len(pick_nodes(scaling, want, {}))
    choice = choose_plan(cfg, room, memory_bound(cfg))
    if choice is None or choice.world_size < least:
        why = no_plan_reason(cfg, room, memory_bound(cfg)) or f"the best layout uses {choice.world_size} of them"
        raise PlacementError(f"room for {room} of {want} workers at the start, and no plan of at least "
                             f"scaling.min_workers({least}) workers runs on them: {why}")
    smaller = plan_for(cfg, choice.dp, choice.pp, choice.stage_bounds, counts)
    check_start(cfg, smaller)
    nodes = find_nodes(scaling, smaller.topology.world_size, {}, left)
    return FirstPlacement(smaller, nodes, {
        "plan_before": {"dp": plan.topology.dp, "pp": plan.topology.pp, "world_size": want},
        "plan_after": {"dp": choice.dp, "pp": choice.pp, "world_size": choice.world_size},
        "room": room, "waited_s": first_wait, "policy": choice.reason})
