"""Ranges of the global sample order a run never reads (``data.skip_samples``): checked and merged.
Where each step's batch then starts is ``data.skips``."""

from __future__ import annotations


def check_ranges(ranges, global_batch: int) -> list[tuple[int, int]]:
    """``ranges`` as sorted, merged ``(start, end)`` pairs; raises ``ValueError`` naming a range that
    is empty or not whole batches of ``global_batch``."""
    out = []
    for r in ranges:
        if len(r) != 2:
            raise ValueError(f"a skipped range is [start, end), got {list(r)}")
        start, end = int(r[0]), int(r[1])
        if not 0 <= start < end:
            raise ValueError(f"skipped range [{start}, {end}) is empty or negative: give [start, end) with start < end")
        if start % global_batch or end % global_batch:
            lo, hi = start // global_batch * global_batch, -(-end // global_batch) * global_batch
            raise ValueError(f"skipped range [{start}, {end}) is not whole batches: start and end must be multiples "
                             f"of train.global_batch_size ({global_batch}), e.g. [{lo}, {hi})")
        out = add_range(out, start, end)
    return out


def add_range(ranges: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """``ranges`` with ``[start, end)`` added, overlapping and touching ranges merged, sorted."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted([*(tuple(r) for r in ranges), (start, end)]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged
