"""Cut an ordered list of blocks into contiguous stages of balanced parameter count."""

from __future__ import annotations


def partition_blocks(param_counts: list[int], num_stages: int) -> list[tuple[int, int]]:
    """Split blocks into ``num_stages`` contiguous, non-empty ``[start, end)`` ranges.

    Minimises the largest stage's parameter count (the pipeline runs at the pace
    of its heaviest stage) by exact dynamic programming; ties go to the cut that
    puts the earlier boundaries first, so the result is deterministic.
    """
    n = len(param_counts)
    if num_stages < 1:
        raise ValueError(f"num_stages({num_stages}) must be >= 1")
    if n < num_stages:
        raise ValueError(f"cannot cut {n} blocks into {num_stages} non-empty stages")
    prefix = [0]
    for c in param_counts:
        prefix.append(prefix[-1] + max(int(c), 0))
    inf = float("inf")
    # best[k][i]: min over cuts of blocks[:i] into k stages of the heaviest stage.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def stage_indices_for_rank(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Pipeline stage indices a PP rank holds: one, or ``virtual_stages`` interleaved ones."""
    return [pp_rank + v * pp for v in range(virtual_stages)]


def blocks_for_rank(stage_bounds, pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Blocks a PP rank holds: those of each of its stages (``stage_bounds``: ``[start, end)`` per stage)."""
    return [b for s in stage_indices_for_rank(pp_rank, pp, virtual_stages) for b in range(*stage_bounds[s])]
