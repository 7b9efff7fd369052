"""Deterministic global sample order with a cursor.

The row of global sample ``g`` is a pure function of (seed, g): epoch ``g // n``
uses its own seeded permutation. The run's cursor is the next global sample
index, so restoring the cursor restores the exact stream regardless of how many
replicas read it.
"""

from __future__ import annotations

import numpy as np


class GlobalSampler:
    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        if num_rows <= 0:
            raise ValueError(f"num_rows must be positive, got {num_rows}")
        self.num_rows = num_rows
        self.seed = seed
        self.shuffle = shuffle
        self._orders: dict[int, np.ndarray] = {}

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # a batch spans at most two epochs
                self._orders.pop(min(self._orders))
            self._orders[epoch] = (
                np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
                if self.shuffle else np.arange(self.num_rows)
            )
        return self._orders[epoch]

    def rows(self, start: int, count: int) -> np.ndarray:
        """Row indices of global samples ``start .. start + count - 1``."""
        g = np.arange(start, start + count)
        epochs, pos = np.divmod(g, self.num_rows)
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._epoch_order(int(e))[pos[mask]]
        return out

    def replica_rows(self, cursor: int, global_batch: int, dp: int, replica: int) -> np.ndarray:
        """Rows of one replica's share of the global batch that starts at ``cursor``."""
        per = global_batch // dp
        return self.rows(cursor + replica * per, per)
