"""Object-store snapshots owned by the controller, each shard pinned on a second node.

After a snapshot step every rank keeps a local copy and returns it as the
step's second result (so the object is owned by the controller and outlives
the worker); the controller asks workers on other nodes to pin a copy (so it
outlives the node). A snapshot commits when every shard has all its copies.
The last two committed stay; older refs are dropped and holders let their old
copies go, so object-store use does not grow with the step count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray

_KEEP_COMMITTED = 2


@dataclass
class ShardEntry:
    ref: object
    blocks: list[int]
    node: str                                   # node of the rank that produced it
    pins: dict[int, object] = field(default_factory=dict)  # holder worker id -> ack ref
    pinned: set = field(default_factory=set)                # holder ids whose copy is stored


@dataclass
class Snapshot:
    step: int
    started: float
    shards: dict[int, ShardEntry]   # rank -> entry
    committed_at: float | None = None


class SnapshotStore:
    def __init__(self, replicas: int):
        self.replicas = replicas
        self.snaps: dict[int, Snapshot] = {}
        self.bytes_last = 0

    def take(self, step: int, ranks: dict[int, tuple], blocks_of_rank: dict[int, list[int]]) -> None:
        """Start replicating snapshot ``step``: ``ranks`` maps rank -> (actor, worker id, node, shard ref).

        The DP replicas of a stage hold bit-identical state (same averaged
        gradients, same optimizer step), so their shards already are copies of
        each other: pins are made only for stages whose replicas sit on fewer
        than ``replicas`` distinct nodes (dp=1, or replicas packed on a node).
        """
        shards = {rank: ShardEntry(ref, blocks_of_rank[rank], node) for rank, (_, _, node, ref) in ranks.items()}
        workers = sorted((w[1], w[0], w[2]) for w in ranks.values())  # (worker id, actor, node)
        groups: dict[tuple, list[int]] = {}
        for rank in sorted(ranks):
            groups.setdefault(tuple(blocks_of_rank[rank]), []).append(rank)
        for members in groups.values():
            used = {shards[r].node for r in members}
            first = members[0]
            entry, wid = shards[first], ranks[first][1]
            # Holders: workers on other nodes, nearest worker id after the producer first.
            order = sorted(workers, key=lambda w: (w[0] - wid) % (workers[-1][0] + 1))
            for h_wid, h_actor, h_node in order:
                if len(used) >= self.replicas:
                    break
                if h_node in used:
                    continue
                used.add(h_node)
                entry.pins[h_wid] = h_actor.pin.remote((step, first), [entry.ref])
        self.snaps[step] = Snapshot(step, time.perf_counter(), shards)

    def poll(self) -> list[int]:
        """Record finished pins; returns steps that committed now."""
        done = []
        for snap in self.snaps.values():
            if snap.committed_at is not None:
                continue
            for e in snap.shards.values():
                waiting = [r for h, r in e.pins.items() if h not in e.pinned]
                if waiting:
                    ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0)
                    for h, r in e.pins.items():
                        if r in ready:
                            try:
                                ray.get(r)
                                e.pinned.add(h)
                            except Exception:
                                pass  # holder died; the shard may still commit via restore-time checks
            if all(len(e.pinned) == len(e.pins) for e in snap.shards.values()):
                snap.committed_at = time.perf_counter()
                done.append(snap.step)
        return done

    def committed_steps(self) -> list[int]:
        return sorted(s for s, snap in self.snaps.items() if snap.committed_at is not None)

    def prune(self) -> None:
        """Keep the last committed snapshots (and newer pending ones); drop the refs of the rest.

        Holders let their pinned copies of old steps go by themselves (TrainWorker.pin).
        """
        committed = self.committed_steps()
        if len(committed) <= _KEEP_COMMITTED:
            return
        cutoff = committed[-_KEEP_COMMITTED]
        for step in [s for s in self.snaps if s < cutoff]:
            del self.snaps[step]

    def available(self, alive_nodes: set[str], alive_workers: set[int]) -> dict[int, dict[int, list[int]]]:
        """Shards that still have a copy: step -> {rank: blocks}. A shard survives if its
        producer's node is alive or a pinned copy sits on a live worker."""
        out: dict[int, dict[int, list[int]]] = {}
        for step, snap in self.snaps.items():
            for rank, e in snap.shards.items():
                if e.node in alive_nodes or any(h in alive_workers for h in e.pinned):
                    out.setdefault(step, {})[rank] = e.blocks
        return out

    def ref(self, step: int, rank: int):
        return self.snaps[step].shards[rank].ref
