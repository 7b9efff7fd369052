"""Where the final weights of each pipeline stage come from: replica 0's worker, else another
live DP replica of the stage (a worker lost after the last step costs nothing: every replica
holds the same weights), else the snapshot of the last step where its parts sit on a live node,
else an error naming the stage and what is gone. Pure functions, chosen by ``saving`` and
``final_weights``."""

from __future__ import annotations

from typing import Callable

from ...errors import RunError, error_line


def stage_replicas(topo, ranks: dict[int, int], alive: set[int], late: frozenset[int] = frozenset()) \
        -> dict[int, list[int]]:
    """Each pipeline stage's live workers (``ranks``: rank -> worker id; ``alive``: worker ids),
    replica 0's first: where the stage's final weights can come from, in the order to ask. Those
    in ``late`` (they missed a ping: gone, or only slow) come after the others, not never."""
    out = {}
    for s in range(topo.pp):
        held = [ranks[topo.rank(d, s)] for d in range(topo.dp) if ranks[topo.rank(d, s)] in alive]
        out[s] = [w for w in held if w not in late] + [w for w in held if w in late]
    return out


def take_stages(order: dict[int, list[int]], ask: Callable[[dict[int, int]], dict]) -> tuple[dict, dict]:
    """Each stage's answer from the first of its workers (``order``: stage -> worker ids) that
    gives one. ``ask`` ({stage: worker} -> {stage: its answer, or the exception it raised})
    asks one worker of every stage still open at once; a stage whose worker failed asks its
    next. Returns ({stage: (worker, answer)} of the stages answered, {worker: why} of those
    that failed); a stage none of whose workers answered is in neither."""
    queues = {s: list(ws) for s, ws in order.items()}
    got: dict[int, tuple] = {}
    failed: dict[int, str] = {}
    while True:
        asks = {s: q.pop(0) for s, q in queues.items() if s not in got and q}
        if not asks:
            return got, failed
        for s, answer in ask(asks).items():
            if isinstance(answer, BaseException):
                failed[asks[s]] = error_line(answer)
            else:
                got[s] = (asks[s], answer)


def exported_parts(order: dict[int, list[int]], sharded: bool, dp: int) -> list[int] | None:
    """The workers whose exports of the last step make the final durable checkpoint when no
    snapshot of it is kept (``order``: stage -> its live workers, as ``stage_replicas`` gives
    them); None if they cannot. A whole stage needs one live replica; a sharded one all of its
    ``dp`` replicas, since each holds only its own slice of the stage's optimizer state: a stage
    with fewer live has lost a slice."""
    if not all(order.values()) or (sharded and any(len(ws) != dp for ws in order.values())):
        return None
    if not sharded:
        return [ws[0] for _, ws in sorted(order.items())]
    return [w for _, ws in sorted(order.items()) for w in ws]


def snapshot_cover(parts: dict[int, tuple], need: set[int], alive_nodes: set[str]) -> list[int] | None:
    """Ranks of a snapshot's parts (rank -> (blocks, node its object is on[, sharded group])) that
    sit on live nodes and together hold every block of ``need``; None if they do not. A sharded
    DP group's parts (slices of the same blocks) are taken all together or not at all."""
    picked, seen = [], set()
    for r, (blocks, node, *rest) in sorted(parts.items()):
        group = rest[0] if rest else None
        mine = set(blocks) & need
        if not mine or mine <= seen:
            continue
        if group is not None:
            if r != group[0] or not all(m in parts and parts[m][1] in alive_nodes for m in group):
                continue
            picked += list(group)
        elif node in alive_nodes:
            picked.append(r)
        else:
            continue
        seen |= mine
    return picked if seen >= need else None


def lost_stages_error(run: str, step: int, lost: dict[int, list[tuple[int, int, str]]],
                      blocks: dict[int, list[int]], newest_snapshot: int | None) -> RunError:
    """The error of final weights that cannot be gathered. ``lost``: stage -> (replica, worker,
    why) of each of its workers; ``blocks``: stage -> its blocks; ``newest_snapshot``: the newest
    step with a snapshot kept, which the emergency copy falls back to."""
    stages = "; ".join(
        f"stage {s} (blocks {_spans(blocks[s])}) has no live replica ("
        + "; ".join(f"replica {d}, worker {w}: {why}" for d, w, why in gone) + ")"
        for s, gone in sorted(lost.items()))
    return RunError(
        f"run {run}: the final weights of step {step} cannot be gathered: {stages} and no snapshot of step "
        f"{step} holds {'it' if len(lost) == 1 else 'them'} on a live node; "
        + (f"the newest snapshot kept is of step {newest_snapshot}: the emergency copy saves the newest one that "
           "survives" if newest_snapshot is not None else "no snapshot is kept to save instead"))


def _spans(blocks: list[int]) -> str:
    """Blocks as runs of consecutive ids: [3, 4, 8, 9] -> '3..4, 8..9'."""
    spans: list[list[int]] = []
    for b in sorted(blocks):
        if spans and b == spans[-1][1] + 1:
            spans[-1][1] = b
        else:
            spans.append([b, b])
    return ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in spans)
