"""Whether a checkpoint's parts hold the whole model: every block, and every element of a
sharded optimizer's moments.

A part's manifest entry names its blocks; a slice of a sharded optimizer (``sliced``) also
names, per parameter, the flat range ``[start, end)`` of the moments it holds and the
parameter's size (``spans``). Files existing is not enough: a final checkpoint written from
one replica of a sharded stage holds 1/dp of its moments, and a resume would refuse it. A
write checks this before its manifest (``DurableStore.commit``), so a checkpoint that exists
is one that resumes.
"""

from __future__ import annotations


def part_spans(shard: dict) -> dict[str, list[int]]:
    """A sliced part's ``name -> [start, end, size]`` of the moments it holds (its ``optim_ranges``
    where cut for a reader, else its ``ranges``); {} for a whole part."""
    ranges = shard.get("ranges") or {}
    optim = shard.get("optim_ranges") or {}
    out = {}
    for name, (start, end, shape) in ranges.items():
        size = 1
        for d in shape:
            size *= int(d)
        s, e = (optim[name][0], optim[name][1]) if name in optim else (start, end)
        out[name] = [int(s), int(e), size]
    return out


def cover_problems(files: list[dict], n_blocks: int) -> list[str]:
    """What ``files`` (manifest entries) leave out of a model of ``n_blocks`` blocks: blocks no part
    holds, and moments' elements that no slice of a sharded group holds. [] when whole."""
    problems = []
    held = {b for f in files for b in f.get("blocks", ())}
    missing = sorted(set(range(n_blocks)) - held)
    if missing:
        problems.append(f"block(s) {missing} in no part")
    groups: dict[tuple, list[dict]] = {}
    for f in files:
        if f.get("sliced"):
            groups.setdefault(tuple(f["blocks"]), []).append(f)
    for blocks, members in sorted(groups.items()):
        if any("spans" not in m for m in members):
            continue   # written before spans were recorded: nothing to hold it to
        spans: dict[str, list[tuple[int, int]]] = {}
        sizes: dict[str, int] = {}
        for m in members:
            for name, (s, e, size) in m["spans"].items():
                spans.setdefault(name, []).append((s, e))
                sizes[name] = size
        for name in sorted(spans):
            got = _covered(spans[name], sizes[name])
            if got < sizes[name]:
                problems.append(f"blocks {list(blocks)}: {name} has {got} of its {sizes[name]} moments' elements "
                                f"in {len(members)} slice(s): a sharded rank's slice is missing")
                break
    return problems


def _covered(spans: list[tuple[int, int]], size: int) -> int:
    total, end = 0, 0
    for s, e in sorted(spans):
        s, e = max(s, end), min(e, size)
        if e > s:
            total += e - s
            end = e
    return total
