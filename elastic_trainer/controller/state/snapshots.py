"""Object-store snapshots owned by the controller, each part with copies on distinct nodes.

After a snapshot step every rank keeps a full local copy of its state. The DP
replicas of a stage hold bit-identical state, so one of them writes the whole
stage to the object store, in turn (``put_phases``), as the step's second
result, owned by the controller so it outlives the worker. The object store
then holds one complete snapshot per step instead of dp of them, in one object
per stage, and every part still has copies on distinct nodes: the writer's
object plus the other replicas' local copies. Where a stage sits on fewer than
``replicas`` nodes (dp=1, or replicas packed on a node) the controller asks
workers on other nodes to pin a copy.

A snapshot commits only on evidence of every copy it counts: each part's
own object sealed (and not an error), every pin answered, and every DP peer
counted for a local copy having reported it (``copied`` in its step results,
which reach the store with the next snapshot step's). It is dropped (its refs
let go, its pins cancelled) when a part's object or a pin fails, or a pin is
not stored within ``failure.pin_timeout_s``: never both. Only committed
snapshots are restore sources. A holder is given at most ``snapshots_kept`` pins
outstanding at once, and none while a pin of a snapshot let go is still
outstanding on it, so a slow holder holds a bounded number of parts. The last
``checkpoint.snapshots_kept`` committed stay; older refs are dropped, and
every pin request tells its holder the oldest step still kept, so holders let
older copies go and object-store use does not grow with the step count.
Workers keep that many local copies too: one number for both.

With a sharded optimizer (``parallel.shard_optimizer``) the replicas of a stage
no longer hold the same state: each holds its slice of the optimizer state.
Every rank then writes its own part, pinned on other nodes, and a stage's
parts count only together: its DP group's parts are one source
(``group`` keys, a tuple of ranks), whole when every one of them has a copy.

A rollback re-runs steps, and takes their snapshots again: ``rolled_back``
lets go of every snapshot after the restored step. Each snapshot is a *take*
(numbered), and a pin's key carries it, so a pin of an earlier take of the
same step that answers late counts for nothing here and replaces no newer
copy on its holder (``worker.copies.HeldCopies.pin``).

This module owns all of it: when a snapshot is due, who writes what, where
copies go, when a snapshot commits and how long it is kept.
"""

from __future__ import annotations

import collections
import itertools
import time

import ray

from .snapshot_parts import ShardEntry, Snapshot, check_sealed, put_phases


class SnapshotStore:
    """The run's object-store snapshots: ``snaps`` (step -> Snapshot), taken, replicated, committed, pruned."""

    def __init__(self, replicas: int, keep: int, pin_timeout_s: float = 30.0):
        self.replicas = replicas
        self.keep = keep
        self.pin_timeout_s = pin_timeout_s
        self.snaps: dict[int, Snapshot] = {}
        self.dropped: list[Snapshot] = []   # dropped since the last poll
        self._stale: dict[int, list] = {}   # holder -> pins of snapshots let go that it has not answered
        self._copied: dict[int, set[int]] = collections.defaultdict(set)  # worker -> steps it reported copied
        self._plan = None
        self._phases: list[dict[int, list[int]]] = [{}]
        self._taken = 0   # scheduled snapshots so far: whose turn it is to write
        self._takes = itertools.count(1)   # numbers every take, so a late pin answer names its own
        self.calls = 0    # pin requests issued so far

    def set_plan(self, plan) -> None:
        """Who writes what from now on: the put phases of ``plan`` (a ``planning.plan.Plan``)."""
        self._plan = plan
        self._phases = put_phases(plan.topology, plan.blocks_of, self.sharded)

    @property
    def sharded(self) -> bool:
        """Whether the plan in force shards its optimizer state over its DP groups."""
        return (self._plan is not None and self._plan.topology.dp > 1
                and self._plan.shard_optimizer != "none")

    def writers(self, after: int = 0) -> dict[int, list[int]]:
        """Rank -> blocks it writes into the object store at the next scheduled snapshot
        (``after``: that many scheduled snapshots not yet handed to ``take_step`` come first)."""
        return self._phases[(self._taken + after) % len(self._phases)]

    def take_step(self, step: int, ranks: dict, shard_refs: dict, full: bool = False, nbytes: int = 0,
                  results: dict | None = None) -> None:
        """Start replicating the parts of ``step`` that the current plan's ranks returned.

        ``ranks``: rank -> ``WorkerHandle``; ``shard_refs``: worker id -> its part's ref;
        ``full``: each rank returned all its blocks (a snapshot off the schedule, which
        does not move the writers' turn); ``results``: worker id -> its result of ``step``,
        whose ``copied`` names the latest step it has made a local copy of (the evidence a
        DP peer's copy of an earlier snapshot exists).
        """
        self.reported(results or {})
        topo = self._plan.topology
        writers = None if full else self.writers()
        parts, peers, groups = {}, {}, {}
        for r, h in ranks.items():
            blocks = self._plan.blocks_of(r) if full else writers[r]
            if not blocks:
                continue
            parts[r] = (h.wid, h.node, shard_refs[h.wid], blocks)
            stage = topo.coords(r)[1]
            if self.sharded:
                groups[r] = tuple(topo.rank(d, stage) for d in range(topo.dp))
                continue   # no peer holds this rank's slice
            peers[r] = {p.wid: p.node for p in (ranks[topo.rank(d, stage)] for d in range(topo.dp)) if p.wid != h.wid}
        self.take(step, parts, [(h.wid, h.actor, h.node) for h in ranks.values()], peers, nbytes, groups)
        if not full:
            self._taken += 1

    def reported(self, results: dict) -> None:
        """Record what step results (worker id -> result) say each worker has copied locally."""
        for wid, out in results.items():
            step = (out or {}).get("copied")
            if step is not None:
                self._copied[wid].add(step)

    def oldest_kept(self) -> int:
        """The oldest step whose snapshot is still kept (committed or not); 0 if none."""
        return min(self.snaps, default=0)

    def take(self, step: int, parts: dict[int, tuple], workers: list[tuple],
             peers: dict[int, dict[int, str]], nbytes: int = 0, groups: dict[int, tuple] | None = None) -> None:
        """Start replicating snapshot ``step``.

        ``parts``: rank -> (worker id, node, shard ref, blocks) of the ranks that
        returned a part; ``workers``: (worker id, actor, node) of every rank, the
        candidate pin holders; ``peers``: rank -> {worker id: node} of the other ranks
        that keep a local copy of that rank's part (its DP peers); ``groups``: rank -> the ranks
        whose parts hold its blocks together (sharded optimizer state).
        """
        if step in self.snaps:
            # Taken again (after a rollback, or whole at the end): the earlier take is not the run's.
            self._let_go(self.snaps.pop(step))
        take = next(self._takes)
        shards = {rank: ShardEntry(ref, blocks, node, wid, group=(groups or {}).get(rank))
                  for rank, (wid, node, ref, blocks) in parts.items()}
        workers = sorted(workers, key=lambda w: w[0])
        keep_from = min(self.oldest_kept() or step, step)
        # A holder takes no new pin with ``keep`` unanswered, nor while it still holds a part
        # of a snapshot let go (its pin has not answered).
        stale, pending = self._stale_holders(), self._unanswered()
        short = []
        for rank, entry in shards.items():
            used = {entry.node}
            for p_wid, p_node in sorted(peers.get(rank, {}).items()):
                if len(used) < self.replicas and p_node not in used:
                    used.add(p_node)
                    entry.peers[p_wid] = p_node
            wid = parts[rank][0]
            # Holders: workers on other nodes, nearest worker id after the producer first.
            order = sorted(workers, key=lambda w: (w[0] - wid) % (workers[-1][0] + 1))
            for h_wid, h_actor, h_node in order:
                if len(used) >= self.replicas:
                    break
                if h_node in used or h_wid in stale or pending[h_wid] >= self.keep:
                    continue
                used.add(h_node)
                entry.pins[h_wid] = h_actor.pin.remote((step, rank, take), [entry.ref], keep_from)
                self.calls += 1
                pending[h_wid] += 1
            if len(used) < min(self.replicas, len({w[2] for w in workers})):
                short.append(rank)
        snap = Snapshot(step, time.perf_counter(), shards, nbytes=nbytes, take=take)
        self.snaps[step] = snap
        if short:
            # Every holder that could take a copy is still storing an older one: this
            # snapshot cannot get its copies, and waiting would only pile parts up.
            self._drop(snap, f"no free holder on another node for the parts of ranks {short}")

    def _unanswered(self) -> collections.Counter:
        """Holder -> pins of kept snapshots it has not answered yet."""
        return collections.Counter(h for snap in self.snaps.values() if snap.committed_at is None
                                   for e in snap.shards.values() for h in e.pins if h not in e.pinned)

    def _stale_holders(self) -> set[int]:
        """Holders with a pin of a snapshot let go still unanswered (until it answers, the holder
        still holds that part)."""
        for h, refs in list(self._stale.items()):
            _, left = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            if left:
                self._stale[h] = left
            else:
                del self._stale[h]
        return set(self._stale)

    def _let_go(self, snap: Snapshot) -> None:
        """``snap`` is no longer kept: its pins still queued are cancelled, and every pin not yet
        answered keeps its holder from new ones until it answers."""
        for e in snap.shards.values():
            for h, ref in e.pins.items():
                if h not in e.pinned:
                    try:
                        ray.cancel(ref)   # a pin still queued lets go of its part now
                    except Exception:  # noqa: BLE001 - already running or done
                        pass
                    self._stale.setdefault(h, []).append(ref)

    def _drop(self, snap: Snapshot, why: str) -> None:
        snap.dropped = why
        self._let_go(snap)
        if self.snaps.get(snap.step) is snap:
            del self.snaps[snap.step]
        self.dropped.append(snap)

    def rolled_back(self, step: int) -> None:
        """The run restored ``step``: snapshots of later steps (and what workers said they copied
        of them) hold state the run no longer has, and those steps will be taken again."""
        for later in [s for s in self.snaps if s > step]:
            self._let_go(self.snaps.pop(later))
        for steps in self._copied.values():
            steps.difference_update([s for s in steps if s > step])

    def poll(self) -> list[Snapshot]:
        """Record finished pins and parts; returns the snapshots that committed now. Those whose
        part or pin failed, or whose pins took longer than ``pin_timeout_s``, are dropped (see
        ``take_dropped``)."""
        done = []
        now = time.perf_counter()
        waiting = [s for s in self.snaps.values() if s.committed_at is None]
        check_sealed(e for snap in waiting for e in snap.shards.values())
        for snap in waiting:
            failed = None
            for rank, e in snap.shards.items():
                if e.error:
                    failed = f"rank {rank}'s part failed: {e.error}"
                unanswered = [r for h, r in e.pins.items() if h not in e.pinned]
                if unanswered:
                    ready, _ = ray.wait(unanswered, num_returns=len(unanswered), timeout=0)
                    for h, r in e.pins.items():
                        if r in ready and h not in e.pinned:
                            try:
                                ray.get(r)
                                e.pinned.add(h)
                            except Exception as ex:  # noqa: BLE001 - the holder died or failed
                                failed = f"pin of rank {rank}'s part on worker {h} failed: {type(ex).__name__}"
            pinned = all(len(e.pinned) == len(e.pins) for e in snap.shards.values())
            if failed is None and not pinned and now - snap.started > self.pin_timeout_s:
                failed = f"its pins were not all stored within failure.pin_timeout_s({self.pin_timeout_s:g})"
            if failed:
                self._drop(snap, failed)
            elif pinned and all(e.sealed and self._proven(snap.step, e) for e in snap.shards.values()):
                snap.committed_at = now
                done.append(snap)
        return done

    def _proven(self, step: int, e: ShardEntry) -> bool:
        """Whether every DP peer counted for a local copy of ``e`` has reported copying ``step``."""
        return all(step in self._copied.get(p, ()) for p in e.peers)

    def take_dropped(self) -> list[Snapshot]:
        """Snapshots dropped since the last call."""
        out, self.dropped = self.dropped, []
        return out

    def steps(self) -> list[int]:
        """Every step whose snapshot is kept, committed or not."""
        return sorted(self.snaps)

    def committed_steps(self) -> list[int]:
        return sorted(s for s, snap in self.snaps.items() if snap.committed_at is not None)

    def prune(self) -> None:
        """Keep the last ``keep`` committed snapshots (and newer pending ones); drop the refs of the rest.

        Holders let their pinned copies of older steps go at the next pin request (TrainWorker.pin).
        """
        committed = self.committed_steps()
        if len(committed) <= self.keep:
            return
        cutoff = committed[-self.keep]
        for step in [s for s in self.snaps if s < cutoff]:
            self._let_go(self.snaps.pop(step))
        for steps in self._copied.values():
            steps.difference_update([s for s in steps if s < cutoff])

    def available(self, alive_nodes: set[str], alive_workers: set[int]) -> dict[int, dict[int, list[int]]]:
        """Parts of committed snapshots that still have a copy: step -> {rank: blocks}. A part
        survives if its producer's node is alive or a pinned copy sits on a live worker. The
        parts of a sharded DP group count together, under the group's key (a tuple of ranks),
        where every one of them survives."""
        out: dict[int, dict[int, list[int]]] = {}
        for step, snap in self.snaps.items():
            if snap.committed_at is None:
                continue
            alive = {rank for rank, e in snap.shards.items()
                     if e.node in alive_nodes or any(h in alive_workers for h in e.pinned)}
            for rank, e in snap.shards.items():
                if e.group is None and rank in alive:
                    out.setdefault(step, {})[rank] = e.blocks
                elif e.group is not None and rank == e.group[0] and set(e.group) <= alive:
                    out.setdefault(step, {})[e.group] = e.blocks
        return out

    def sealed_groups(self, step: int, alive_workers: set[int], wait_s: float = 0.0) -> dict[tuple, list[int]]:
        """The parts of ``step``'s snapshot, committed or not, that a re-plan between steps (every
        writer alive) can restore from: a sharded DP group's parts, by the group's key, where each
        is in the object store and its writer lives. ``wait_s``: how long to wait for parts still
        being written first. Not for a failure's restore: an uncommitted part has no copy elsewhere."""
        snap = self.snaps.get(step)
        if snap is None:
            return {}
        entries = list(snap.shards.values())
        pending = [e.ref for e in entries if not e.sealed and e.error is None]
        if pending and wait_s > 0:
            ray.wait(pending, num_returns=len(pending), timeout=wait_s, fetch_local=False)
        check_sealed(entries)
        out = {}
        for rank, e in snap.shards.items():
            if e.group is None or rank != e.group[0]:
                continue
            members = [snap.shards.get(r) for r in e.group]
            if all(m is not None and m.sealed and m.wid in alive_workers for m in members):
                out[e.group] = e.blocks
        return out

    def written(self, alive_workers: set[int]) -> dict[int, dict[int, tuple]]:
        """Sealed parts whose writer is alive: worker id -> {step: (ref, blocks)}. A rank that
        writes all its blocks keeps no other copy of that step; its part, on its own
        node, is its local copy (the live tier of a restore), once it is in the object store."""
        check_sealed(e for snap in self.snaps.values() for e in snap.shards.values())
        out: dict[int, dict[int, tuple]] = {}
        for step, snap in self.snaps.items():
            for e in snap.shards.values():
                # A sharded part is a slice of its blocks: a source only with its group's.
                if e.wid in alive_workers and e.sealed and e.group is None:
                    out.setdefault(e.wid, {})[step] = (e.ref, e.blocks)
        return out

    def ref(self, step: int, rank: int):
        return self.snaps[step].shards[rank].ref

    def sliced(self, step: int, rank: int) -> bool:
        """Whether ``rank``'s part of ``step`` is a sharded optimizer's slice of its blocks."""
        return self.snaps[step].shards[rank].group is not None

    def writer(self, step: int, rank: int) -> int | None:
        """The worker that produced ``rank``'s part of ``step``."""
        return self.snaps[step].shards[rank].wid

    def live_holder(self, step: int, rank: int, alive_nodes: set[str], alive_workers: set[int]) -> int | None:
        """A live worker holding a pinned copy of ``rank``'s part of ``step`` when the node that
        produced the part is gone (else None: the part's own object is the one to read)."""
        e = self.snaps[step].shards[rank]
        if e.node in alive_nodes:
            return None
        return next((h for h in sorted(e.pinned) if h in alive_workers), None)

    def covering(self, step: int, n_blocks: int, alive_nodes: set[str] | None = None,
                 alive_workers: set[int] | None = None, with_nodes: bool = False) -> list | None:
        """Refs of parts of ``step`` that together hold every block, or None if they do not.

        With ``alive_*`` (what survives, to restore or save from): only a committed snapshot,
        and only its parts with a surviving copy. Without them (the durable writer's "write this
        step now"): the kept snapshot's parts as they are, committed or not yet; its write
        reads them and fails on any that never came. ``with_nodes``: (ref, node of its object,
        the worker that made it, its blocks, its sharded group or None).
        """
        snap = self.snaps.get(step)
        if snap is None or (alive_nodes is not None and snap.committed_at is None):
            return None
        def survives(e: ShardEntry) -> bool:
            return alive_nodes is None or e.node in alive_nodes or bool(e.pinned & (alive_workers or set()))

        picked, seen = [], set()
        for rank, e in sorted(snap.shards.items()):
            if e.group is not None:
                # A sharded group's parts go together, each a slice of the same blocks.
                if rank != e.group[0] or set(e.blocks) <= seen:
                    continue
                members = [snap.shards.get(r) for r in e.group]
                if not all(m is not None and survives(m) for m in members):
                    continue
                picked += [(m.ref, m.node, m.wid, list(m.blocks), e.group) if with_nodes else m.ref for m in members]
                seen |= set(e.blocks)
                continue
            if not survives(e):
                continue
            if not set(e.blocks) <= seen:
                picked.append((e.ref, e.node, e.wid, list(e.blocks), None) if with_nodes else e.ref)
                seen |= set(e.blocks)
        return picked if seen >= set(range(n_blocks)) else None
