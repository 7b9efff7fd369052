"""Recovery on lab hosts (``lab/``): a host killed, cut off, or frozen, at dp=2 x pp=2.

Four worker hosts and a head, each a network namespace with its own address and
a cgroup with a CPU quota; one Ray node on each. The demo GPT trains; once step
K is done the host of rank 3 is lost one way:

- kill: every process of its cgroup, SIGKILL;
- cut: its link down (nothing closes), healed once the run re-planned, 5 s at the least;
- freeze: its cgroup frozen, thawed the same way.

Reported per fault: seconds from the fault to the first step completed after
the recovery and to its detection (the run's own times against the fault's,
one machine's clock), with the recovery's parts, median and spread over the
rounds.

Two more parts (``_lab_capacity``): the throughput kept after losing 1 of 4
and 2 of 6 hosts, against a fresh run started on the survivors with the
planner's layout for them, in the same lab; and the false suspicions on a
host loaded by a CPU burner. And ``--part comm`` (``_lab_comm``): every
communication mode at 1 Gbit/s and 200 Mbit/s links beside Ray Train DDP,
with the cost model's prediction of each from a sweep across the hosts.
Needs root, iproute2 and cgroups; run on a quiet machine:

    python benchmarks/lab.py                         # 5 rounds of each fault
    python benchmarks/lab.py --faults kill --rounds 3
    python benchmarks/lab.py --part throughput --rounds 2
    python benchmarks/lab.py --part suspicion --rounds 2
    python benchmarks/lab.py --part comm --caps 1000,200 --steps 30

Targets (issue: the lab): at most 1.5 s for a kill, and the heartbeat timeout
plus 1.5 s for a cut-off or frozen host; after a loss, 95% of a fresh run's
throughput on the same survivors (issue: preemptible fleets); at 200 Mbit/s the best mode at most
0.5x the uncompressed step and 2x faster than Ray Train DDP; the cost model
within 15% at both caps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The repository first: ``lab`` is the package there, not this file (whose folder Python put first).
sys.path.insert(0, str(ROOT))

from lab import Lab, LabRun, missing  # noqa: E402  (first: recovery puts this folder first again)

from _lab_capacity import suspicion_round, throughput_round  # noqa: E402
from _lab_comm import MODES, one_cap, report  # noqa: E402
from recovery import demo_config  # noqa: E402

FAILURE = {"startup_timeout_s": 60, "min_step_timeout_s": 5, "rendezvous_timeout_s": 20, "wait_for_nodes_s": 2}


def one_round(lab: Lab, fault: str, steps: int, at: int, out: Path) -> dict:
    cfg = demo_config(steps, f"lab-{fault}", parallel={"dp": 2, "pp": 2}, checkpoint={"memory_every": 1},
                      failure=FAILURE)
    run = LabRun(lab, cfg, out)
    ranks = run.await_step(at)
    victim = lab.host_at(ranks[3])
    plan = run.plan()
    t0 = time.time()
    if fault == "kill":
        lab.kill(victim)
    else:
        (lab.cut if fault == "cut" else lab.freeze)(victim)
        run.await_new_plan(than=plan)
        time.sleep(max(0.0, 5.0 - (time.time() - t0)))   # back 5 s after the loss at the least
        (lab.heal if fault == "cut" else lab.thaw)(victim)
    result = run.result()
    if "error" in result:
        raise RuntimeError(f"{fault}: the run failed: {result['error']}")
    rec = result["recoveries"][0]
    # The run's own clock (the controller's, on this machine): when it saw the loss, when the
    # first step after the recovery completed.
    return {"fault": fault, "fault_to_first_step_s": round(rec["resumed_at"] - t0, 3),
            "fault_to_detect_s": round(rec["detected_at"] - t0, 3), "reason": rec["reason"],
            "replan_s": rec["replan_s"], "restore_s": rec["restore_s"], "first_step_s": rec["first_step_s"],
            "steps_redone": rec["steps_redone"], "plan_after": rec["plan_after"]}


def summary(rows: list[dict]) -> dict:
    out = {}
    for fault in dict.fromkeys(r["fault"] for r in rows):
        xs = sorted(r["fault_to_first_step_s"] for r in rows if r["fault"] == fault)
        out[fault] = {"median_s": round(statistics.median(xs), 3), "min_s": xs[0], "max_s": xs[-1], "rounds": len(xs)}
    return out


def capacity(args) -> int:
    """``--part throughput`` or ``suspicion``: rounds on their own lab, figures to ``--out``."""
    rows = []
    cases = [(4, 1), (6, 2)] if args.part == "throughput" else [(4, 0)]
    for hosts, lose in cases:
        # Equal quotas that fit the machine's cores with the head's beside them.
        cpus = args.cpus_per_host if args.part == "suspicion" else min(args.cpus_per_host, 1.5 / hosts)
        with Lab(hosts=hosts + 1, cpus_per_host=cpus, head_cpus=0.5) as lab, \
                tempfile.TemporaryDirectory() as tmp:
            lab.start_ray()
            for i in range(args.rounds):
                lab.revive()
                out = Path(tmp) / f"{args.part}-{hosts}-{i}"
                row = (throughput_round(lab, hosts, lose, args.window, out) if args.part == "throughput"
                       else suspicion_round(lab, args.steps, out))
                row["cpus_per_host"] = cpus
                print(json.dumps(row), flush=True)
                rows.append(row)
    Path(args.out).write_text(json.dumps({"part": args.part, "rows": rows}, indent=1))
    if args.part == "throughput":
        print("\nlost       kept of a fresh run on the survivors (median, min-max)   plan after")
        for hosts, lose in cases:
            xs = sorted(r["kept_of_ideal"] for r in rows if r["hosts"] == hosts)
            plan = next(r["plan_after"] for r in rows if r["hosts"] == hosts)
            print(f"{lose} of {hosts}     {statistics.median(xs):.1%} ({xs[0]:.1%}-{xs[-1]:.1%}), {len(xs)} rounds"
                  f"      dp={plan['dp']} pp={plan['pp']}")
    else:
        print(f"\nsuspected {sum(r['suspected'] for r in rows)}, answered again "
              f"{sum(r['answered_again'] for r in rows)}, killed for silence "
              f"{sum(r['killed_for_silence'] for r in rows)}, over {sum(r['steps'] for r in rows)} steps")
    return 0


def comm(args) -> int:
    """``--part comm``: a lab a cap, figures to ``--out``."""
    caps, compute = [], None
    modes = [tuple(m.split("/")) for m in args.modes.split(",")] if args.modes else MODES
    with tempfile.TemporaryDirectory() as tmp:
        for cap in (float(c) for c in args.caps.split(",")):
            row, compute = one_cap(cap, min(args.cpus_per_host, 1.5 / 4), args.steps, args.warmup, args.max_bytes,
                                   Path(tmp), compute, modes)
            caps.append(row)
            Path(args.out).write_text(json.dumps({"part": "comm", "caps": caps}, indent=1, default=str))
            # The link's constants, for `elastic-trainer plan JOB --constants FILE` to choose by.
            Path(args.out).with_name(f"lab-constants-{cap:g}mbit.json").write_text(
                json.dumps(row["constants"], indent=1, default=str))
    report(caps)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("recovery", "throughput", "suspicion", "comm"), default="recovery")
    ap.add_argument("--caps", default="1000,200", help="comm: link caps, Mbit/s")
    ap.add_argument("--modes", default=None, help="comm: compression/sync pairs, comma-separated (default: all)")
    ap.add_argument("--warmup", type=int, default=10, help="comm: steps left out of each median")
    ap.add_argument("--max-bytes", type=int, default=16 << 20, help="comm: the sweep's largest all-reduce")
    ap.add_argument("--window", type=int, default=25, help="throughput: steady steps measured before and after")
    ap.add_argument("--faults", default="kill,cut,freeze")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fault-at", type=int, default=15)
    ap.add_argument("--cpus-per-host", type=float, default=0.4)
    ap.add_argument("--out", default=None, help="default benchmarks/results/lab[-PART].json")
    args = ap.parse_args()
    suffix = "" if args.part == "recovery" else f"-{args.part}"
    args.out = args.out or str(ROOT / "benchmarks" / "results" / f"lab{suffix}.json")
    why = missing()
    if why:
        print(f"cannot build a lab here: {why}")
        return 2
    if args.part == "comm":
        return comm(args)
    if args.part != "recovery":
        return capacity(args)
    rows = []
    with Lab(hosts=5, cpus_per_host=args.cpus_per_host) as lab, tempfile.TemporaryDirectory() as tmp:
        lab.start_ray()
        for i in range(args.rounds):
            for fault in args.faults.split(","):
                lab.revive()
                row = one_round(lab, fault, args.steps, args.fault_at, Path(tmp) / f"{fault}-{i}")
                print(json.dumps(row), flush=True)
                rows.append(row)
    doc = {"rows": rows, "summary": summary(rows), "cpus_per_host": args.cpus_per_host}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print("\nfault   fault -> first step after (median, min-max)")
    for fault, s in doc["summary"].items():
        print(f"{fault:7s} {s['median_s']:.2f} s ({s['min_s']:.2f}-{s['max_s']:.2f}), {s['rounds']} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
