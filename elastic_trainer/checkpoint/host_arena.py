"""Host memory for snapshot copies: one arena per worker, within a budget, reused across re-plans.

On a GPU a snapshot is copied device-to-host into page-locked (pinned) memory,
so the copy runs beside the next step. torch's caching host allocator never
gives pinned memory back, and rounds each allocation up to a power of two: a
worker that allocated its copy buffers afresh at every re-plan kept every old
layout's buffers pinned. Here a worker takes its copy buffers from an arena
that it keeps for its whole life:

- the arena grows in chunks (a power of two each, so the allocator's rounding
  is memory the arena uses) only while its total stays within the budget;
- a buffer that nothing views any more goes back to the arena, and the next
  layout's buffers are carved from the same chunks;
- a buffer that does not fit within the budget is ordinary pageable memory
  (a GPU then copies into it more slowly) and is counted (``overflow_bytes``);
- the arena lives as long as the worker's process, which ends with the run:
  the host gets the pinned memory back then, and not before.

On a CPU the chunks are ordinary memory: the arena still spares the page
faults of a fresh allocation after every re-plan.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger(__name__)

ALIGN = 64          # bytes: every buffer starts aligned
MIN_CHUNK = 64 << 20  # bytes: small layouts share one chunk instead of pinning many small ones


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _window(chunk: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of ``chunk`` from ``offset``, as an array that is the base of its own views:
    numpy would make a slice's views point at the chunk, and then whether anything still views
    one buffer could not be told from the others (``flat._BlockBuffer.free``)."""
    return np.frombuffer(memoryview(chunk)[offset:offset + nbytes], dtype=np.uint8)


class Region:
    """One buffer carved from the arena (``chunk`` None: outside the budget, pageable)."""

    __slots__ = ("chunk", "offset", "nbytes", "array")

    def __init__(self, chunk: int | None, offset: int, nbytes: int, array: np.ndarray):
        self.chunk, self.offset, self.nbytes, self.array = chunk, offset, nbytes, array


class HostArena:
    """Copy buffers for one worker's snapshots: ``take`` one, ``give`` it back once nothing views it.

    ``budget_bytes``: what the chunks may hold in all (None: no bound). ``pinned``: page-locked
    chunks (for copies from a GPU)."""

    def __init__(self, budget_bytes: int | None, pinned: bool = False, label: str = "worker"):
        self.budget_bytes = budget_bytes
        self.pinned = pinned
        self.label = label
        self._chunks: list[np.ndarray] = []
        self._free: list[list[tuple[int, int]]] = []   # per chunk: (offset, size), sorted, coalesced
        self.overflow_bytes = 0     # pageable buffers in use now, past the budget
        self._warned = False

    @property
    def nbytes(self) -> int:
        """Bytes the arena's chunks hold (in use or free)."""
        return sum(c.nbytes for c in self._chunks)

    @property
    def free_bytes(self) -> int:
        return sum(size for spans in self._free for _, size in spans)

    def take(self, nbytes: int) -> Region:
        """A buffer of ``nbytes``: from a free span of a chunk, else a new chunk within the budget,
        else pageable memory outside it."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, spans in enumerate(self._free):
            for j, (off, span) in enumerate(spans):
                if span >= size:
                    spans[j:j + 1] = [(off + size, span - size)] if span > size else []
                    return Region(i, off, size, _window(self._chunks[i], off, nbytes))
        chunk = self._new_chunk(size)
        if chunk is None:
            self.overflow_bytes += size
            if not self._warned:
                self._warned = True
                log.warning("%s: snapshot copies need more host memory than checkpoint.host_memory_gb "
                            "gives (%.2f GiB held); the rest is pageable, so copies from a GPU are slower",
                            self.label, self.nbytes / (1 << 30))
            return Region(None, 0, size, np.empty(nbytes, dtype=np.uint8))
        i = len(self._chunks) - 1
        if chunk.nbytes > size:
            self._free[i].append((size, chunk.nbytes - size))
        return Region(i, 0, size, _window(chunk, 0, nbytes))

    def _new_chunk(self, size: int) -> np.ndarray | None:
        # torch pins a power of two whatever is asked: ask for one, and use all of it.
        want = max(_pow2_at_least(size), MIN_CHUNK)
        room = None if self.budget_bytes is None else self.budget_bytes - self.nbytes
        if room is not None and want > room:
            least = _pow2_at_least(size) if self.pinned else size
            if least > room:
                return None
            want = least if self.pinned else room
        if self.pinned:
            chunk = torch.empty(want, dtype=torch.uint8, pin_memory=True).numpy()
        else:
            chunk = np.empty(want, dtype=np.uint8)
        self._chunks.append(chunk)
        self._free.append([])
        return chunk

    def give(self, region: Region) -> None:
        """``region`` is free again (its caller made sure nothing views it)."""
        if region.chunk is None:
            self.overflow_bytes -= region.nbytes
            return
        spans = self._free[region.chunk]
        spans.append((region.offset, region.nbytes))
        spans.sort()
        merged: list[tuple[int, int]] = []
        for off, size in spans:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((off, size))
        spans[:] = merged
        region.array = None
