"""Deterministic global sample order with a cursor.

The window of global sample ``g`` is a pure function of (seed, g): epoch ``g // n``
has its own seeded order. The run's cursor is the next global sample index, so
restoring the cursor restores the exact stream regardless of how many replicas
read it.

The order is shuffled with locality, for a streaming reader: a full random
permutation would read a different row group for nearly every sample. Instead the
windows are cut into blocks of ``block`` consecutive windows, the blocks are put in
a seeded order, and the windows of every ``mix`` consecutive blocks of that order
are shuffled together. A step then reads from about ``mix`` blocks (when
``block * mix`` is a multiple of the global batch), and each block's row groups
are read once per mix rather than once per sample. With blocks of one window and
one mix for the whole epoch (``data_order`` picks it for a corpus that fits the
read-ahead) the order is the plain seeded permutation of every window.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

_MIXES_KEPT = 8  # a batch touches one or two mixes; a few more serve replicas reading behind


class GlobalSampler:
    """Window index of every global sample: see the module docstring for the order."""

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True, block: int = 64, mix: int = 16):
        if num_rows <= 0:
            raise ValueError(f"num_rows must be positive, got {num_rows}")
        if block < 1 or mix < 1:
            raise ValueError(f"block({block}) and mix({mix}) must be at least 1")
        self.num_rows = num_rows
        self.seed = seed
        self.shuffle = shuffle
        self.block = block
        self.mix = mix
        self._span = block * mix  # windows of every mix but the last of an epoch
        self._blocks: dict[int, np.ndarray] = {}
        self._mixes: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def _block_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._blocks:
            if len(self._blocks) >= 2:  # a batch spans at most two epochs
                self._blocks.pop(min(self._blocks))
            full = self.num_rows // self.block
            order = np.random.default_rng([self.seed, epoch]).permutation(full)
            if self.num_rows % self.block:
                # The one short block goes last, so that every mix but the last is exactly block * mix long.
                order = np.append(order, full)
            self._blocks[epoch] = order
        return self._blocks[epoch]

    def _mix_order(self, epoch: int, j: int) -> np.ndarray:
        key = (epoch, j)
        if key in self._mixes:
            self._mixes.move_to_end(key)
        else:
            if len(self._mixes) >= _MIXES_KEPT:
                self._mixes.popitem(last=False)
            size = min(self._span, self.num_rows - j * self._span)
            self._mixes[key] = np.random.default_rng([self.seed, epoch, j]).permutation(size)
        return self._mixes[key]

    def _epoch_rows(self, epoch: int, pos: np.ndarray) -> np.ndarray:
        if self.block == 1 and self._span >= self.num_rows:
            # One mix of single windows is a plain permutation: drawn as the in-memory reader drew
            # it, so a corpus that fits the read-ahead keeps the order (and the figures) it had.
            return self._block_order(epoch)[pos]
        order = self._block_order(epoch)
        mixes = pos // self._span
        out = np.empty(len(pos), dtype=np.int64)
        for j in np.unique(mixes):
            j = int(j)
            mask = mixes == j
            # Offset q in the mix's concatenated windows is window q % block of its (q // block)-th block.
            q = self._mix_order(epoch, j)[pos[mask] - j * self._span]
            out[mask] = order[j * self.mix + q // self.block] * self.block + q % self.block
        return out

    def rows(self, start: int, count: int) -> np.ndarray:
        """Window indices of global samples ``start .. start + count - 1``."""
        g = np.arange(start, start + count, dtype=np.int64)
        epochs, pos = np.divmod(g, self.num_rows)
        if not self.shuffle:
            return pos
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._epoch_rows(int(e), pos[mask])
        return out

    def replica_rows(self, cursor: int, global_batch: int, dp: int, replica: int,
                     shares: list[int] | None = None) -> np.ndarray:
        """Rows of one replica's share of the global batch that starts at ``cursor``: equal shares,
        or ``shares`` samples per replica (balancing), taken in replica order, so that every split
        reads the same samples."""
        if shares is None:
            per = global_batch // dp
            return self.rows(cursor + replica * per, per)
        return self.rows(cursor + sum(shares[:replica]), shares[replica])
