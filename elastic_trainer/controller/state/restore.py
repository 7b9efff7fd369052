"""Where each block's state comes from when a plan is (re)built, and what each rank loads. Pure: no Ray.

Sources, best first: a live worker's local copy (no transfer beyond the
survivors), the object-store snapshot, the durable checkpoint. The restore
step is the latest one at which every block has a source; all blocks come from
that one step, never a mix.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """Where blocks of one step are; exactly one of ``worker``, ``part``, ``shard`` is set, by ``tier``."""

    tier: str                  # "live" | "snapshot" | "durable"
    step: int
    blocks: frozenset
    worker: int | None = None  # live: the worker whose local copy holds the blocks
    part: object = None        # snapshot: the key of the part (the rank that produced it)
    shard: int | None = None   # durable: the shard's index in the checkpoint


def choose_restore(
    n_blocks: int,
    live: dict[int, dict[int, list[int]]],
    snapshots: dict[int, dict[object, list[int]]],
    durable: dict[int, dict[object, list[int]]],
    max_step: int | None = None,
    allowed: set[int] | None = None,
) -> tuple[int, dict[int, Source]] | None:
    """Latest step (up to ``max_step``, the last committed one) at which every block
    has a source, and each block's source.

    A copy of a step that did not commit (some rank never reported it) is never
    used, even if the survivors hold all of it. ``allowed``: where state outside the
    blocks (a parameter server's optimizer shards) can come back only at some steps,
    those steps.

    ``live``: worker id -> {step: blocks in its local copy}; ``snapshots`` and
    ``durable``: step -> {shard key: blocks}. Returns None if no step covers
    every block.
    """
    steps = set(snapshots) | set(durable)
    for per_step in live.values():
        steps |= set(per_step)
    for step in sorted(steps, reverse=True):
        if (max_step is not None and step > max_step) or (allowed is not None and step not in allowed):
            continue
        cands: list[Source] = []
        for wid in sorted(live):
            if step in live[wid]:
                cands.append(Source("live", step, frozenset(live[wid][step]), worker=wid))
        for key, blocks in sorted(snapshots.get(step, {}).items(), key=lambda kv: str(kv[0])):
            cands.append(Source("snapshot", step, frozenset(blocks), part=key))
        for key, blocks in sorted(durable.get(step, {}).items(), key=lambda kv: str(kv[0])):
            cands.append(Source("durable", step, frozenset(blocks), shard=key))
        chosen: dict[int, Source] = {}
        for src in cands:  # tier order: the first source of a block wins
            for b in src.blocks:
                chosen.setdefault(b, src)
        if all(b in chosen for b in range(n_blocks)):
            return step, chosen
    return None


@dataclass(frozen=True)
class Load:
    """One thing a rank loads at a restore: ``kind`` says which, and which field names it.

    - ``local``: the rank's own local copy of the step;
    - ``written``: the snapshot part ``worker`` wrote at the step (that object is its copy);
    - ``export``: ``blocks`` exported from live ``worker``'s local copy;
    - ``snapshot``: the object-store part ``part``;
    - ``durable``: durable shard ``shard``.
    """

    kind: str
    worker: int | None = None
    blocks: tuple = ()
    part: object = None
    shard: int | None = None


def plan_loads(chosen: dict[int, Source], ranks: dict[int, int], blocks_of_rank: dict[int, list[int]],
               own: dict[int, list[int]], written: dict[int, list[int]]) -> dict[int, list[Load]]:
    """Per rank, what to load so that it holds its blocks at the chosen step.

    ``ranks``: rank -> worker id; ``own``: worker id -> blocks of its own local
    copy of the step; ``written``: worker id -> blocks of the snapshot part it
    wrote at the step (a writer of its whole stage keeps no other copy). A
    rank takes its own copies first, then each remaining block from the source
    ``chosen`` for it.
    """
    out = {}
    for r, w in ranks.items():
        need = set(blocks_of_rank[r])
        loads: list[Load] = []
        mine = need & set(own.get(w, []))
        if mine:
            loads.append(Load("local"))
            need -= mine
        if w in written and need & set(written[w]):
            loads.append(Load("written", worker=w))
            need -= set(written[w])
        by_src: dict[Source, set] = {}
        for b in need:
            by_src.setdefault(chosen[b], set()).add(b)
        for src, blocks in sorted(by_src.items(), key=lambda kv: min(kv[1])):
            if src.tier == "live" and src.worker in written and blocks <= set(written[src.worker]):
                loads.append(Load("written", worker=src.worker))
            elif src.tier == "live":
                loads.append(Load("export", worker=src.worker, blocks=tuple(sorted(blocks))))
            elif src.tier == "snapshot":
                # A sharded DP group's parts (a tuple of ranks) are read together.
                loads += [Load("snapshot", part=p) for p in (src.part if isinstance(src.part, tuple) else [src.part])]
            else:
                loads += [Load("durable", shard=i) for i in (src.shard if isinstance(src.shard, tuple) else [src.shard])]
        out[r] = loads
    return out


def newest_copies(n_blocks: int, copies: list[tuple[int, int, str, bool]]) -> str:
    """Where each block's newest copies are, for the error of a restore that found no step
    whole: ``copies`` are (block, step, where, reachable) of every copy the run knows of."""
    lines = []
    for b in range(n_blocks):
        mine = sorted((c for c in copies if c[0] == b), key=lambda c: (-c[1], not c[3]))
        if not mine:
            lines.append(f"block {b}: no copy")
            continue
        newest = mine[0][1]
        where = [f"{w} ({'reachable' if ok else 'lost'})" for _, s, w, ok in mine if s == newest]
        ok = next((c for c in mine if c[3]), None)
        tail = f"; newest reachable: step {ok[1]} in {ok[2]}" if ok and ok[1] != newest else ""
        lines.append(f"block {b}: step {newest} in " + ", ".join(where) + (tail if ok else "; none reachable"))
    return "; ".join(lines)
