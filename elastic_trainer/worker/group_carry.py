"""Carrying a DP or PP subgroup from one plan's world into the next.

A re-plan builds a new default group (its world changed), and torch ties every
subgroup to the default group it was made in: ``destroy_process_group``
shuts them all down, and the subgroup's member ranks are the old world's.
A survivor whose group has the same members in the same order in the new
plan has nothing to rebuild, though: gloo's connections are the same.
So the group is taken out of torch's registry before the old world goes
(``detach``), and put back once the new world stands (``attach``), with its
members' ranks in the new world. Its own rank in the group and its
connections are untouched.

torch (2.13) has no public way to do this; the registry's maps are the
module's own (``distributed_c10d._world``), which this module alone touches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch.distributed import distributed_c10d as _c10d

log = logging.getLogger(__name__)


@dataclass
class Detached:
    """A subgroup out of torch's registry, with what it needs to go back in."""

    pg: object
    name: str
    backend_config: object
    store_entry: tuple
    tag: str | None


def detach(pg) -> Detached:
    """Take ``pg`` out of the registry, so the old world's destruction leaves it connected."""
    w = _c10d._world
    d = Detached(pg=pg, name=w.pg_names.pop(pg), backend_config=w.pg_backend_config.pop(pg),
                 store_entry=w.pg_map.pop(pg), tag=w.pg_to_tag.pop(pg, None))
    w.pg_group_ranks.pop(pg, None)
    w.pg_coalesce_state.pop(pg, None)
    for members in w.tags_to_pg.values():
        while pg in members:
            members.remove(pg)
    return d


def attach(d: Detached, global_ranks: list[int]) -> object:
    """Put a detached group back into the current world: its ``i``-th member is the world's rank
    ``global_ranks[i]``. Returns the group."""
    w = _c10d._world
    if w.default_pg is None:
        raise RuntimeError("a group can only be carried into a world that exists (init_process_group first)")
    if len(global_ranks) != d.pg.size():
        raise ValueError(f"the carried group has {d.pg.size()} members, the new plan gives it {len(global_ranks)}")
    w.pg_map[d.pg] = d.store_entry
    w.pg_names[d.pg] = d.name
    w.pg_group_ranks[d.pg] = {g: i for i, g in enumerate(global_ranks)}
    w.pg_backend_config[d.pg] = d.backend_config
    if d.tag is not None:
        w.pg_to_tag[d.pg] = d.tag
        w.tags_to_pg.setdefault(d.tag, []).append(d.pg)
        w.tags_to_pg.setdefault("", []).append(d.pg)
    try:
        _c10d._register_process_group(d.name, d.pg)
    except RuntimeError:
        # A group made in this world took the same name (names hash the old ranks): only
        # lookups by name (functional collectives, not used here) miss the carried one.
        log.debug("carried group %s shares its name with a new one; not registered by name", d.name)
    return d.pg


def sequence(pg) -> int:
    """How many operations this rank has issued on ``pg`` (gloo counts each at issue, point-to-
    point ones too): equal among its members when none waits inside one."""
    return int(pg._get_sequence_number_for_group())
