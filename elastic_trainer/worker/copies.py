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
"""

from __future__ import annotations

import threading


class HeldCopies:
    def __init__(self):
        self.keep = 0                          # local copies kept; set from the plan's config at set-up
        self.local: dict[int, dict] = {}       # step -> this rank's state after that step
        self.pins: dict[tuple, object] = {}    # (step, rank) -> another rank's snapshot part
        self._takes: dict[tuple, int] = {}     # (step, rank) -> the take of the part held
        self._newest = 0                       # the newest take a pin request has named
        self._lock = threading.Lock()

    def add_local(self, step: int, shard: dict) -> None:
        """Keep ``shard`` as the local copy of ``step``, letting the oldest beyond ``keep`` go."""
        with self._lock:
            self.local[step] = shard
            for old in sorted(self.local)[:-self.keep] if self.keep else ():
                del self.local[old]

    def make_room(self) -> None:
        """Before a new local copy is made: keep only ``keep - 1``, so that with the one being
        filled a worker never holds more than ``keep`` copies of its state."""
        with self._lock:
            for old in sorted(self.local)[:-(self.keep - 1)] if self.keep > 1 else list(self.local):
                del self.local[old]

    def local_copy(self, step: int) -> dict:
        with self._lock:
            return self.local[step]

    def local_blocks(self) -> dict[int, list[int]]:
        """Steps held locally, with the blocks each covers whole. A sharded optimizer's copy
        (``ranges``) holds a slice of its blocks: a restore reads it with its DP group's other
        slices, through the snapshot's parts, never as blocks of its own."""
        with self._lock:
            return {s: sh["blocks"] for s, sh in self.local.items() if not sh.get("ranges")}

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
