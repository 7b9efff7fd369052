"""Which survivors of a failed step only a cut of their groups can free (``stuck``), read off the
``group_state`` answers the settle round gathers (``group_settle``)."""

from __future__ import annotations

from ..run.group_carry import Key


def stuck(states: dict[int, object]) -> set[int]:
    """The workers whose step only a cut can end, from ``group_state`` answers: each is blocked
    (``waiting``, read off its frames by ``worker.wait_site``) in a group it holds whole, every
    other member of which has left its step, having issued more operations on it than one of
    them did; the operation it waits on is one that member will never issue. The counts say
    that only where each operation has its match on every member: a DP group (the same
    collectives in the same order) or a group of two (a send's match is the other's receive).
    A pipeline group of more stages is never read as stuck; its wait runs out instead."""
    seqs: dict[Key, dict[int, int]] = {}
    for wid, state in states.items():
        if isinstance(state, dict):
            for role, (members, seq) in state["held"].items():
                seqs.setdefault((role, tuple(members)), {})[wid] = seq
    out = set()
    for wid, state in states.items():
        if not isinstance(state, dict) or not state["busy"] or state.get("waiting") not in state["held"]:
            continue
        members, seq = state["held"][state["waiting"]]
        key = (state["waiting"], tuple(members))
        if key[0] != "dp" and len(members) != 2:
            continue
        others = {w: q for w, q in seqs[key].items() if w != wid}
        if (set(others) == set(members) - {wid}
                and all(not states[w]["busy"] for w in others) and seq > min(others.values())):
            out.add(wid)
    return out
