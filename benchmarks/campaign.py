"""The long fault campaign: many seeded schedules against real runs on a simulated cluster of
this machine, each held to the checker's invariants (elastic_trainer.chaos.campaign).

Reported: schedules run, violations (each shrunk to a replay command), the fault kinds and
points struck, the time each schedule took, and the recovery times across every struck fault
(median, p90, worst), not only the easy ones. Run on a quiet machine:

    python benchmarks/campaign.py --schedules 100             # seeds 0.. (the covering ones first)
    python benchmarks/campaign.py --schedules 20 --seed 500   # other seeds
    python benchmarks/campaign.py --replay '<schedule json>'  # one schedule, as a failure prints it
    python benchmarks/campaign.py --lab --schedules 30        # on lab hosts (root, iproute2, cgroups)

On the lab (``lab/``), each rank, spare and joining node is a host of its own (a network namespace
with a fraction of a core and a memory limit) and the faults add a cut link and a kernel memory kill;
the campaign's driver runs on the head host (``lab.campaign``).

Target: zero violations over 100 schedules (and 30 on the lab).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from elastic_trainer.chaos.campaign.campaign import Setting, draws, report_doc, run_campaign
    from elastic_trainer.chaos.campaign.schedule import Schedule

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedules", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--replay", metavar="JSON")
    ap.add_argument("--lab", action="store_true", help="on lab hosts (root, iproute2, cgroups)")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--out", default="campaign.json", help="every outcome and the coverage, as JSON")
    args = ap.parse_args()
    setting = Setting(steps=args.steps)
    schedules = ([Schedule.from_json(args.replay)] if args.replay
                 else draws(args.schedules, setting, args.seed, lab=args.lab))
    t0 = time.monotonic()
    if args.lab:
        doc = lab_campaign(setting, schedules, args)
        if doc is None:
            return 2
    else:
        doc = report_doc(run_campaign(schedules, setting, shrink_failures=not args.no_shrink))
    return finish(doc, t0, args.out)


def finish(doc: dict, t0: float, out: str) -> int:
    """Print the wall time, the schedules' times and the coverage; write ``doc`` to ``out``; the
    exit status (1 on a violation, or on anything a lab left)."""
    import json

    from elastic_trainer.chaos.campaign.campaign import coverage_line

    secs = [r["seconds"] for r in doc["runs"]]
    print(f"wall {time.monotonic() - t0:.0f}s; a schedule took median {statistics.median(secs):.1f}s "
          f"({min(secs):.1f}-{max(secs):.1f})")
    print(coverage_line(doc["coverage"]))
    if doc.get("lab_leftovers"):
        print(f"the lab left: {doc['lab_leftovers']}")
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    return 1 if doc["violations"] or doc.get("lab_leftovers") else 0


def lab_campaign(setting, schedules, args) -> dict | None:
    """The lab's report of ``schedules`` (None, said why, where this machine holds no lab)."""
    import dataclasses
    import tempfile

    from lab import missing
    from lab.campaign import run_lab_campaign

    why = missing()
    if why:
        print(f"no lab on this machine: {why}", file=sys.stderr)
        return None
    with tempfile.TemporaryDirectory(prefix="et-lab-campaign-") as d:
        return run_lab_campaign({"setting": dataclasses.asdict(setting), "schedules": [s.to_json() for s in schedules],
                                 "shrink": not args.no_shrink}, d)


if __name__ == "__main__":
    sys.exit(main())
