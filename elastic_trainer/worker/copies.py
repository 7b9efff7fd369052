"""What a worker holds for snapshots and restores: its own local copies, and pinned copies of other ranks' parts.

The worker's side of the controller's snapshot bookkeeping
(``controller.snapshots``): local copies are the live tier of a restore, and
the newest ``checkpoint.snapshots_kept`` are kept (the step being committed
counts, so the controller's oldest committed snapshot may have no local copy
left: a restore then takes it from the object store). A pinned copy is let
go once a pin request says the controller no longer keeps its step, which
the controller tells before pruning, so holders keep up to one snapshot more
than it does. Thread-safe: the training thread adds copies while control
calls read them.

Each local copy carries the set-up generation it was made under. After a
rollback, the steps past the restored one were of a timeline the run
abandoned; a copy of one of them (still here, or in flight when the step
failed and added after) must never be restored once the new timeline passes
that step number again. The controller names its restores as
``(generation, restored step)`` (``RunRecord.timeline``) and a copy counts
only where no later set-up restored a step before it (``on_timeline``).
"""

from __future__ import annotations

import threading


class HeldCopies:
    def __init__(self):
        self.keep = 0                          # local copies kept; set from the plan's config at set-up
        self.local: dict[int, dict] = {}       # step -> this rank's state after that step
        self.made_in: dict[int, int] = {}      # step -> the set-up generation its local copy was made under
        self.pins: dict[tuple, object] = {}    # (step, rank) -> another rank's snapshot part
        self._takes: dict[tuple, int] = {}     # (step, rank) -> the take of the part held
        self._newest = 0                       # the newest take a pin request has named
        self._lock = threading.Lock()

    def add_local(self, step: int, shard: dict, generation: int = 0, timeline: list | None = None) -> bool:
        """Keep ``shard`` as the local copy of ``step``, made under set-up ``generation``, letting
        the oldest beyond ``keep`` go; False if it was not kept: a copy that ``timeline`` (the
        restores known here) shows is of an abandoned timeline, or an older generation's copy
        of a step held from a newer one (a copy in flight across a set-up that came late).
        Neither may evict a copy of the run's own timeline."""
        with self._lock:
            if not on_timeline(step, generation, timeline or ()) or self.made_in.get(step, -1) > generation:
                return False
            self.local[step] = shard
            self.made_in[step] = generation
            for old in sorted(self.local)[:-self.keep] if self.keep else ():
                del self.local[old]
                self.made_in.pop(old, None)
            return True

    def drop_abandoned(self, timeline: list) -> list[int]:
        """Let go of every local copy that ``timeline`` shows is of an abandoned timeline; their steps."""
        with self._lock:
            gone = [s for s in self.local if not on_timeline(s, self.made_in.get(s, 0), timeline)]
            for s in gone:
                del self.local[s]
                self.made_in.pop(s, None)
            return gone

    def make_room(self) -> None:
        """Before a new local copy is made: keep only ``keep - 1``, so that with the one being
        filled a worker never holds more than ``keep`` copies of its state."""
        with self._lock:
            for old in sorted(self.local)[:-(self.keep - 1)] if self.keep > 1 else list(self.local):
                del self.local[old]
                self.made_in.pop(old, None)

    def local_copy(self, step: int) -> dict:
        with self._lock:
            return self.local[step]

    def local_blocks(self, timeline: list | None = None) -> dict[int, list[int]]:
        """Steps held locally on the run's ``timeline``, with the blocks each covers whole. A
        sharded optimizer's copy (``ranges``) holds a slice of its blocks: a restore reads it with
        its DP group's other slices, through the snapshot's parts, never as blocks of its own."""
        with self._lock:
            return {s: sh["blocks"] for s, sh in self.local.items()
                    if not sh.get("ranges") and on_timeline(s, self.made_in.get(s, 0), timeline or ())}

    def pinned(self, key: tuple):
        """The pinned copy of the part ``key`` = (step, rank): the latest take of it held here."""
        key = tuple(key[:2])
        with self._lock:
            if key not in self.pins:
                raise KeyError(f"no pinned copy of step {key[0]}, rank {key[1]} here; held: {sorted(self.pins)}")
            return self.pins[key]

    def pin(self, key: tuple, value, keep_from: int) -> int:
        """Hold ``value`` as the copy of ``key`` = (step, rank, take); let pins of steps before
        ``keep_from`` go. A step is taken again after a rollback, with a later take number: a
        request of an earlier take that comes late (its snapshot no longer the run's) neither
        replaces a later take's copy of its part nor, with its older ``keep_from``, lets go of
        copies taken since."""
        step, rank, take = (*key, 0)[:3]
        with self._lock:
            if take >= self._takes.get((step, rank), 0):
                self.pins[(step, rank)] = value
                self._takes[(step, rank)] = take
            if take >= self._newest:
                self._newest = take
                for k in [k for k in self.pins if k[0] < keep_from]:
                    del self.pins[k]
                    self._takes.pop(k, None)
            return len(self.pins)


def on_timeline(step: int, generation: int, timeline) -> bool:
    """Whether a copy of ``step`` made under set-up ``generation`` is of the run's timeline:
    no set-up after it (``timeline``: ``(generation, restored step)`` of each) restored a step
    before ``step``, which would have rolled ``step`` back."""
    return all(step <= restored for gen, restored in timeline if gen > generation)
