"""A snapshot's parts: the entry of each rank's part (its object, its pins, its peers' copies),
who writes which blocks in which phase, and whether each part's object is sealed.

Split from ``snapshots`` (which decides when a snapshot commits and how long it is kept): these
are the values it keeps and the two reads it makes of the object store, without its policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray

from ...errors import error_line


@dataclass
class ShardEntry:
    ref: object
    blocks: list[int]
    node: str                                   # node of the rank that produced it
    wid: int | None = None                      # worker that produced it
    pins: dict[int, object] = field(default_factory=dict)  # holder worker id -> ack ref
    pinned: set = field(default_factory=set)                # holder ids whose copy is stored
    peers: dict[int, str] = field(default_factory=dict)     # DP peer worker id -> node, counted for its local copy
    sealed: bool = False                        # its own object is in the object store, not an error
    error: str | None = None                    # why its own object failed
    group: tuple | None = None                  # sharded: the ranks whose parts hold the blocks together


@dataclass
class Snapshot:
    step: int
    started: float
    shards: dict[int, ShardEntry]   # rank -> entry
    committed_at: float | None = None
    nbytes: int = 0                 # one copy of every part
    dropped: str | None = None      # why it was dropped (then it is no longer kept)
    take: int = 0                   # which take of its step (a step is taken again after a rollback)


def put_phases(topo, blocks_of, sharded: bool = False) -> list[dict[int, list[int]]]:
    """Blocks each rank writes into the object store, one ``{rank: blocks}`` per phase.

    One replica of each stage writes the stage's blocks (``blocks_of(rank)``)
    and the others write nothing; the writer changes from phase to phase, and
    stages start from different replicas so that one snapshot's writers sit on
    different nodes. One object per stage rather than one part per rank: each
    object costs the object store a fixed amount of work (create, seal, pin,
    free) that outweighs copying a few more megabytes. ``sharded``: each rank
    holds a state of its own (its optimizer slice), and writes it every time.
    """
    if sharded:
        return [{r: list(blocks_of(r)) for r in range(topo.world_size)}]
    phases = []
    for phase in range(topo.dp):
        out = {}
        for stage in range(topo.pp):
            for replica in range(topo.dp):
                rank = topo.rank(replica, stage)
                out[rank] = list(blocks_of(rank)) if replica == (phase + stage) % topo.dp else []
        phases.append(out)
    return phases


def check_sealed(entries) -> None:
    """Mark each part whose own object is in the object store (``sealed``) or failed (``error``),
    without waiting. A get would pull every part to the controller's node, so where Ray's
    record (the controller owns every part) places the object in a node's store, or spilled,
    it holds a value (a task's error is a small object, kept with its owner); only an object
    kept with the owner is read, which moves nothing."""
    todo: dict[object, list[ShardEntry]] = {}
    for e in entries:
        if not e.sealed and e.error is None:
            todo.setdefault(e.ref, []).append(e)
    if not todo:
        return
    ready, _ = ray.wait(list(todo), num_returns=len(todo), timeout=0, fetch_local=False)
    where = ray.experimental.get_local_object_locations(ready) if ready else {}
    for ref in ready:
        loc, sealed, error = where.get(ref) or {}, True, None
        if not (loc.get("node_ids") or loc.get("did_spill")):
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                sealed = False
            except Exception as ex:  # noqa: BLE001 - the writer died or its part failed
                sealed, error = False, error_line(ex)
        for e in todo[ref]:
            e.sealed, e.error = sealed, error
