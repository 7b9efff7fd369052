"""Spot churn: goodput through one seeded trace of preemptions, against Ray Train v2 and torchft.

One seeded churn trace (``_spot_trace.make_trace``: preemptions with 30 s or 120 s of notice, a
quarter without notice, each lost node replaced 20-60 s after it died) is replayed, timed from
each system's first completed step, against:

- elastic_trainer, defaults (snapshots at ``memory_every: auto``, leases, live grow), the demo
  GPT at dp=4 x pp=1 on four one-CPU simulated nodes: a notice is a drain through the GCS
  (``DrainNode``, reason PREEMPTION), the node is killed at its deadline
  (``remove_node(allow_graceful=False)``), a replacement is ``add_node``;
- Ray Train v2's ``TorchTrainer`` on the same cluster, model and data (DDP over gloo), elastic
  ``ScalingConfig(num_workers=(min, 4))``, a checkpoint every ``--ckpt-every`` steps and on a
  preemption notice, as its docs advise (``_spot_ray_train.py``);
- torchft (lighthouse + a ``Manager`` per replica group, 4 groups as processes over gloo), which
  has no notice path: it gets the trace's losses as SIGKILLs and its replacements as new groups
  that heal from a live peer (``_spot_torchft.py``).

The global batch is the same in every step and every system. Goodput is measured from the
outside, alike for all (``_spot_trace.measure``): the wall time of the steps that count (a
step done twice counts once) over the run's wall time, start-up included; elastic_trainer's
own breakdown (``Result.goodput``) is printed beside it. Run on a quiet machine
(``pip install -e ".[bench]"``):

    python benchmarks/spot.py                          # the 10-minute trace, all three
    python benchmarks/spot.py --systems elastic --duration 180

Targets: goodput at least 97% (snapshot overhead counted); lost time at most a fifth of Ray
Train v2's and at most torchft's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _spot_trace import RayFleet, Replayer, dump, make_trace, measure, trace_line  # noqa: E402
from recovery import demo_config, start_cluster  # noqa: E402

SLOTS = 4
SYSTEMS = ("elastic", "ray_train", "torchft")


def run_elastic(raw: dict, trace, cluster, nodes) -> dict:
    """elastic_trainer at its defaults through the trace; the outside measure and its own."""
    from elastic_trainer import Trainer, TrainerConfig

    replayer = Replayer(trace, RayFleet(cluster, nodes))
    wall_start = time.time()
    try:
        result = Trainer(TrainerConfig.model_validate(raw), verbose=False,
                         on_step=lambda rec: replayer.begin()).fit()
    finally:
        wall_end = time.time()
        replayer.stop()
    records = [{"step": r["step"], "start": r["time"] - r["step_time_s"], "end": r["time"]}
               for r in result.history]
    out = measure(records, wall_start, wall_end)
    # History keeps each step once; the steps a roll-back threw away are the recoveries' count.
    out["steps_redone"] = sum(r["steps_redone"] for r in result.recoveries)
    drains = [e for e in result.events if e["kind"] == "drain"]
    out.update({
        "system": "elastic_trainer (defaults)", "own_goodput": result.goodput,
        "failures": len(result.failures), "recoveries": [r["reason"] for r in result.recoveries],
        "drains": [{k: d.get(k) for k in ("outcome", "left_s", "move_estimate_s", "seconds", "ranks")}
                   for d in drains],
        "worlds": sorted({r["world_size"] for r in result.history}),
        "losses": [r["loss"] for r in result.history], "trace_log": replayer.log,
    })
    return out


def _line(name: str, m: dict) -> str:
    buckets = ", ".join(f"{k} {v:.1f}" for k, v in m["lost_by_bucket"].items() if v >= 0.05)
    return (f"  {name:34s} goodput {m['goodput'] * 100:5.1f}%  wall {m['wall_s']:6.1f} s  "
            f"step {m['steps']} at {m['time_to_last_step_s']:6.1f} s  redone {m['steps_redone']:4d}  "
            f"lost {m['lost_s']:5.1f} s ({buckets})")


def report(out: dict) -> None:
    print(f"\nspot trace seed {out['seed']}, {out['duration_s']:g} s: {out['trace']}; "
          f"{out['steps']} steps of the demo GPT at dp=4 (global batch {out['global_batch']})")
    runs = out["runs"]
    for key in SYSTEMS:
        if key in runs:
            print(_line(runs[key]["system"], runs[key]))
    if "elastic" in runs:
        e = runs["elastic"]
        own = e["own_goodput"]
        print(f"  elastic_trainer's own clock: {own['goodput'] * 100:.1f}% of {own['wall_s']:.1f} s; lost "
              + ", ".join(f"{k} {v:.1f} s" for k, v in own["seconds"].items() if k != "training" and v >= 0.05))
        print(f"  drains: {[d['outcome'] for d in e['drains']]}; failures {e['failures']}; "
              f"recoveries {e['recoveries']}; worlds {e['worlds']}")
        for key in ("ray_train", "torchft"):
            if key in runs:
                r = runs[key]
                ratio = e["lost_s"] / r["lost_s"] if r["lost_s"] > 0 else float("inf")
                word = "less" if ratio < 1 else "more"
                print(f"  elastic_trainer lost {ratio:.2f}x the time {r['system']} lost "
                      f"({e['lost_s']:.1f} s vs {r['lost_s']:.1f} s: {word})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of churn in the trace")
    ap.add_argument("--mean-gap", type=float, default=75.0, help="the trace's mean seconds between losses")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps of every run (default: enough for elastic_trainer to outlive the trace)")
    ap.add_argument("--step-s", type=float, default=0.125,
                    help="the demo's step at dp=4 on this machine, to size the default --steps")
    ap.add_argument("--ckpt-every", type=int, default=50, help="Ray Train's checkpoint interval, in steps")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    args = ap.parse_args()

    import ray

    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.data.dataset import ensure_prepared

    ensure_prepared(TrainerConfig.model_validate(demo_config(1, "prep")).data)
    trace = make_trace(args.seed, args.duration, SLOTS, mean_gap_s=args.mean_gap)
    steps = args.steps or int((args.duration + 30) / args.step_s)
    raw = demo_config(steps, "spot", parallel={"dp": SLOTS, "pp": 1})
    out = {"seed": args.seed, "duration_s": args.duration, "trace": trace_line(trace), "events": dump(trace),
           "steps": steps, "global_batch": raw["train"]["global_batch_size"], "runs": {}}
    print(f"spot trace seed {args.seed}: {out['trace']}; {steps} steps", flush=True)
    work = tempfile.mkdtemp(prefix="et-spot-")
    for key in args.systems.split(","):
        if key not in SYSTEMS:
            raise SystemExit(f"--systems: {key!r} is not one of {', '.join(SYSTEMS)}")
        print(f"{key} ...", flush=True)
        if key == "torchft":
            from _spot_torchft import run_torchft_spot

            out["runs"][key] = run_torchft_spot(raw, trace, steps, os.path.join(work, key))
            continue
        cluster, nodes = start_cluster(SLOTS)
        try:
            if key == "elastic":
                out["runs"][key] = run_elastic(raw, trace, cluster, nodes)
            else:
                from _spot_ray_train import run_ray_train_spot

                out["runs"][key] = run_ray_train_spot(raw, trace, cluster, nodes, steps, args.ckpt_every,
                                                      os.path.join(work, key))
        finally:
            ray.shutdown()
            cluster.shutdown()
        print(_line(out["runs"][key]["system"], out["runs"][key]), flush=True)
    report(out)
    res = ROOT / "benchmarks" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / f"spot-{args.seed}.json").write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
