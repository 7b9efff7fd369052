"""What a plan's set-up reports: the slowest rank's time in each part, the state moved to
restore it, the blocks built or reused, and how the ranks' groups were formed."""

from __future__ import annotations

from ...worker.actor import SETUP_PARTS
from ..run.group_carry import count_groups
from ..state.restore_check import check_restore


def setup_report(outs: dict[int, dict], keys: dict[int, dict[str, list[int]]]) -> tuple[dict, dict]:
    """From every rank's ``setup`` answer (rank -> answer) and the plan's group keys
    (``group_carry.plan_keys``): (part -> seconds of the slowest rank, the restore's figures)."""
    timings = {k: max(o["timings"][k] for o in outs.values()) for k in SETUP_PARTS}
    moved = sum(o["moved"]["bytes"] for o in outs.values())
    fetch_s = max(o["moved"]["seconds"] for o in outs.values())
    report = {"restore_bytes": moved, "restore_fetch_s": fetch_s,
              # What every rank taking its blocks' whole state from the parts it read would have moved.
              "restore_regather_bytes": sum(o["moved"].get("regather", 0) for o in outs.values()),
              # Ranks fetch at once, so the rate is the bytes over the longest fetch: what the restore saw.
              "restore_rate_bytes_s": moved / fetch_s if moved and fetch_s > 0 else None,
              # Each rank's share, to find the one a slow restore waited for.
              "restore_ranks": {r: {"fetch_s": round(o["timings"]["fetch"], 3), "load_s": round(o["timings"]["load"], 3),
                                    "bytes": o["moved"]["bytes"]} for r, o in sorted(outs.items())},
              # checkpoint.verify_restores: the restored state against the saved, tensor by tensor.
              "restore_check": check_restore({r: o.get("fingerprints") for r, o in outs.items()},
                                             {r: o["blocks"] for r, o in outs.items()}),
              # The set-up generations of the local copies each rank read: the evidence that none
              # was of a timeline the run abandoned (worker.copies.on_timeline).
              "local_generations": {r: sorted(set(o["moved"].get("local_generations", [])))
                                    for r, o in sorted(outs.items()) if o["moved"].get("local_generations")},
              "blocks_built": sum(len(o["build"]["built"]) for o in outs.values()),
              "blocks_reused": sum(len(o["build"]["reused"]) for o in outs.values()),
              # How the ranks joined: in the survivors' shrunk world, or by rendezvous.
              "groups": "shrunk" if all(o.get("world") == "shrunk" for o in outs.values()) else "rendezvous",
              **count_groups(keys, {r: o.get("carried", []) for r, o in outs.items()}),
              # The groups' parts (store and arrival, world, dp, pp, the carried ones' check), slowest rank.
              "group_parts": {k: max(o.get("group_parts", {}).get(k, 0.0) for o in outs.values())
                              for k in sorted({k for o in outs.values() for k in o.get("group_parts", {})})}}
    return timings, report
