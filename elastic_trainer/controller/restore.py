"""Where each block's state comes from when a plan is (re)built. Pure: no Ray.

Sources, best first: a live worker's local copy (no transfer beyond the
survivors), the object-store snapshot, the durable checkpoint. The restore
step is the latest one at which every block has a source; all blocks come from
that one step, never a mix.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    tier: str          # "live" | "snapshot" | "durable"
    step: int
    holder: object     # worker id (live), shard key (snapshot), shard index (durable)
    blocks: frozenset


def choose_restore(
    n_blocks: int,
    live: dict[int, dict[int, list[int]]],
    snapshots: dict[int, dict[object, list[int]]],
    durable: dict[int, dict[object, list[int]]],
    max_step: int | None = None,
) -> tuple[int, dict[int, Source]] | None:
    """Latest step (up to ``max_step``, the last committed one) at which every block
    has a source, and each block's source.

    A copy of a step that did not commit (some rank never reported it) is never
    used, even if the survivors hold all of it.

    ``live``: worker id -> {step: blocks in its local copy}; ``snapshots`` and
    ``durable``: step -> {shard key: blocks}. Returns None if no step covers
    every block.
    """
    steps = set(snapshots) | set(durable)
    for per_step in live.values():
        steps |= set(per_step)
    for step in sorted(steps, reverse=True):
        if max_step is not None and step > max_step:
            continue
        cands: list[Source] = []
        for wid in sorted(live):
            if step in live[wid]:
                cands.append(Source("live", step, wid, frozenset(live[wid][step])))
        for key, blocks in sorted(snapshots.get(step, {}).items(), key=lambda kv: str(kv[0])):
            cands.append(Source("snapshot", step, key, frozenset(blocks)))
        for key, blocks in sorted(durable.get(step, {}).items(), key=lambda kv: str(kv[0])):
            cands.append(Source("durable", step, key, frozenset(blocks)))
        chosen: dict[int, Source] = {}
        for src in cands:  # tier order: the first source of a block wins
            for b in src.blocks:
                chosen.setdefault(b, src)
        if all(b in chosen for b in range(n_blocks)):
            return step, chosen
    return None
