"""What driving every step from one controller costs as the run grows: N workers of a tiny model.

The real controller runs N data-parallel workers (dp=N, pp=1) of a 2-layer,
d_model 16 GPT on 4 simulated nodes, N/4 workers a node (each asks for 1/ (N/4)
of its node's one CPU), snapshots at the default (``memory_every: auto``).
For each N it reports, from the run's own step records after ``--warmup``
steps:

- the controller's time per step (``controller_s`` in the step record): the
  step's wall time minus the slowest worker's whole ``train_step`` call (what
  issuing, waiting for and gathering the step costs); with leases
  (``--lease-steps``), on each rank's own clock, the time from the end of its
  last call to the end of the lease, minus the most any rank spent in its
  step calls, spread over the lease's steps; mean, median and 90th
  percentile;
- of that, how long the ranks waited for a grant that had not come when the
  slowest of them ended the step before (``grant_wait_s``): the part the
  controller's own pace decides; the rest is Ray handing each rank its next
  call (a lease renewed while the last one runs, ``control.renew_early``,
  waits in the rank's queue, so its grant wait is 0);
- the controller process's CPU seconds per step (``controller_cpu_s`` in the
  step record, all its threads, Ray's sending and taking of its calls
  included): what driving costs apart from waiting for a core, which on
  this 2-core host with N worker processes is most of its wall time; and
  per second of the run (its share of a core), since the heartbeat's
  questions come per unit of time, not per step;
- beside it, the step's time beyond the slowest worker's compute and exposed
  communication (``step_time_s - worker_s``, the first measure): it also
  holds each rank's own Python between its passes;
- the actor calls the controller makes per step (its running count,
  ``actor_calls`` in the step record: ``train_step`` and ``snapshot_part`` per
  rank, pings after a failure, pins of snapshot parts);
- the snapshot commits: how many snapshot steps ran (at dp >= 2 on distinct
  nodes a part needs no pins, its replicas' local copies are its copies, so
  a snapshot commits as its parts are taken: there is no latency to time);
- one recovery: a node killed mid-run, its phases (detect, re-plan, restore,
  first step), the rendezvous and group building within the restore, and how
  many groups the next plan carried and built (``failure.keep_groups``).

Then it fits each figure against N (linear ``a + b N`` and power ``a N^b``,
least squares on the data, the better by residual kept), prints the fitted
form beside the data, and projects to 1,000 and 10,000 ranks.

Run on a quiet machine (each N starts N worker processes; 32 on this
2-core, 23 GB host take about a minute to start):

    python benchmarks/control_plane.py                    # N = 4, 8, 16, 32
    python benchmarks/control_plane.py --workers 4,8,16,32,64
    python benchmarks/control_plane.py --lease-steps 1,16 --memory-every 16 --no-recovery   # with leases and without
    python benchmarks/control_plane.py --lease-steps 16-end,16 --memory-every 16 --no-recovery   # renewed at the end, early
    python benchmarks/control_plane.py --pp 2             # dp=N/2 x pp=2: groups carried on a loss

Writes benchmarks/results/control_plane.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NODES = 4


def tiny_config(n: int, steps: int, name: str, corpus: str, lease: int | str = 1, memory_every="auto",
                pp: int = 1, keep_groups: bool = True, renew_early: bool = True) -> dict:
    per_node = max(1, n // NODES)
    raw = {
        "control": {"lease_steps": lease, "renew_early": renew_early},
        "checkpoint": {"memory_every": memory_every},
        "run": {"name": name, "log_every": 100_000, "report_dir": None, "output_dir": tempfile.mkdtemp()},
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "d_model": 16},
        "data": {"path": corpus, "seq_len": 16},
        "train": {"steps": steps, "global_batch_size": n, "micro_batch_size": 1, "lr": 1e-3, "seed": 1},
        "parallel": {"dp": n, "pp": 1},
        "scaling": {"resources_per_worker": {"CPU": 1.0 / per_node}, "placement_timeout_s": 600},
        "comm": {"timeout_s": 120},
        "failure": {"startup_timeout_s": 600, "keep_groups": keep_groups},
        "balance": {"mode": "off"},
    }
    if pp > 1:
        # Pipelines of two, a replica's stages on one node: the node killed takes whole replicas,
        # and the others' pipeline groups are carried into the next plan. The memory given a
        # worker holds half the model, not all of it, so the re-plan stays pp=2, and a global
        # batch of 3 N divides among the replicas left (3 N / 8 of them).
        raw["parallel"] = {"dp": n // pp, "pp": pp}
        raw["train"]["global_batch_size"] = 3 * n
        raw["scaling"].update({"worker_memory_gb": _half_model_bound(raw), "replica_placement": "spread"})
    return raw


def _half_model_bound(raw: dict) -> float:
    """GiB between what a rank of the pp=2 layout needs and what the whole model on one rank
    needs, by the planner's memory model (the process itself is most of either)."""
    from elastic_trainer import TrainerConfig
    from elastic_trainer.models.factory import block_param_counts
    from elastic_trainer.planning.plan import make_plan
    from elastic_trainer.planning.policy import rank_estimates

    cfg = TrainerConfig.model_validate(raw)
    par = raw["parallel"]
    two = max(r["bounded"] for r in rank_estimates(cfg, par["dp"], par["pp"], make_plan(cfg).stage_bounds))
    whole = max(r["bounded"] for r in rank_estimates(cfg, 1, 1, [(0, len(block_param_counts(cfg.model)))]))
    return (two + whole) / 2 / (1 << 30)


def calls_per_step(history: list[dict]) -> float:
    """Actor calls the controller issued per step: its running count (``actor_calls``) over the steps."""
    if len(history) < 2:
        return float("nan")
    return (history[-1]["actor_calls"] - history[0]["actor_calls"]) / (len(history) - 1)


def lease_spec(spec: str) -> tuple[int | str, bool]:
    """``16``: leases of 16, each renewed while the last runs (``control.renew_early``);
    ``16-end``: granted once the last one's results are in; ``auto``: the default's."""
    steps, _, when = spec.partition("-")
    if when not in ("", "end") or not (steps == "auto" or steps.isdigit()):
        raise SystemExit(f"--lease-steps: {spec!r} is not N, auto, N-end or auto-end")
    return (steps if steps == "auto" else int(steps)), when != "end"


def run_one(n: int, steps: int, warmup: int, corpus: str, kill: bool, lease: str = "1", memory_every="auto",
            pp: int = 1, keep_groups: bool = True) -> dict:
    from ray.cluster_utils import Cluster
    import ray

    from elastic_trainer import Trainer, TrainerConfig

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [c.add_node(num_cpus=1) for _ in range(NODES)]
    c.wait_for_nodes()
    ray.init(address=c.address)
    try:
        count, early = lease_spec(lease)
        raw = tiny_config(n, steps, f"cp{n}l{count}{'' if early else 'e'}{'k' if kill else ''}", corpus, count,
                          memory_every, pp, keep_groups, early)
        cfg = TrainerConfig.model_validate(raw)
        done = set()

        def on_step(rec):
            if kill and rec["step"] >= steps // 2 and "k" not in done:
                done.add("k")
                c.remove_node(nodes[-1], allow_graceful=False)

        t0 = time.perf_counter()
        result = Trainer(cfg, verbose=False, on_step=on_step).fit()
        wall = time.perf_counter() - t0
    finally:
        ray.shutdown()
        c.shutdown()
    h = [r for r in result.history[warmup:] if r["plan"] == 0]
    # The step's time beyond the slowest rank's call; a lease's spread over its steps.
    over = sorted(r["controller_s"] for r in h)
    # And beyond the slowest rank's compute and exposed communication, as first measured: this
    # also holds each rank's own Python between its passes, which no driving removes.
    beyond = [r["step_time_s"] - r["worker_s"] for r in h]
    out = {"workers": n, "lease_steps": lease, "steps": len(h), "wall_s": wall,
           "controller_s_median": statistics.median(over), "controller_s_p90": over[int(0.9 * (len(over) - 1))],
           "controller_s_mean": statistics.fmean(over), "beyond_compute_s_mean": statistics.fmean(beyond),
           # As a share of the step: on this host every worker shares two cores, so the step
           # itself grows with N, and so does any time a rank waits for a core between leases.
           "controller_share_of_step": statistics.fmean(r["controller_s"] / r["step_time_s"] for r in h
                                                        if r["step_time_s"]),
           # Of the controller's time, the ranks' wait for a grant that had not come when their last
           # step ended (``grant_wait_s``); what is left is Ray handing a rank its next call.
           "grant_wait_s_mean": statistics.fmean(r["grant_wait_s"] or 0.0 for r in h),
           "step_s_median": statistics.median(r["step_time_s"] for r in h),
           "calls_per_step": calls_per_step(h),
           # The controller process's CPU (all its threads) per step: what driving costs, apart
           # from waiting for one of this host's two cores.
           "controller_cpu_s_per_step": (h[-1]["controller_cpu_s"] - h[0]["controller_cpu_s"]) / max(1, len(h) - 1),
           # And per second of the run: its heartbeat asks each node every quarter of
           # failure.heartbeat_timeout_s, so a longer step holds more of them.
           "controller_cpu_share": (h[-1]["controller_cpu_s"] - h[0]["controller_cpu_s"]) / max(1e-9, h[-1]["time"] - h[0]["time"]),
           "snapshot_steps": sum(1 for r in h if r.get("snapshot"))}
    if kill and result.recoveries:
        rec = result.recoveries[0]
        out["recovery"] = {k: rec.get(k) for k in ("detect_s", "replan_s", "restore_s", "first_step_s", "total_s",
                                                   "groups_carried", "groups_built")}
        # The rendezvous and the groups' building: the slowest rank's (restore's ``groups`` part).
        out["recovery"]["rendezvous_s"] = (rec.get("restore_parts") or {}).get("groups")
        out["recovery"]["group_parts"] = rec.get("group_parts")
        out["recovery"]["plan_after"] = rec.get("plan_after")
    return out


def fit(xs: list[float], ys: list[float]) -> dict:
    """The better of ``a + b x`` and ``a x^b`` by least squares (the power fit in log space)."""
    n = len(xs)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    lin = {"form": "a + b N", "a": a, "b": b, "f": lambda x: a + b * x}
    fits = [lin]
    if all(y > 0 for y in ys) and n >= 2:
        lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
        mlx, mly = statistics.fmean(lx), statistics.fmean(ly)
        s = sum((x - mlx) ** 2 for x in lx)
        pb = sum((x - mlx) * (y - mly) for x, y in zip(lx, ly)) / s if s else 0.0
        pa = math.exp(mly - pb * mlx)
        fits.append({"form": "a N^b", "a": pa, "b": pb, "f": lambda x: pa * x ** pb})
    for f in fits:
        f["rss"] = sum((f["f"](x) - y) ** 2 for x, y in zip(xs, ys))
    best = min(fits, key=lambda f: f["rss"])
    return {"form": best["form"], "a": best["a"], "b": best["b"], "rss": best["rss"],
            "at_1000": best["f"](1000), "at_10000": best["f"](10000),
            "others": [{k: f[k] for k in ("form", "a", "b", "rss")} for f in fits if f is not best]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="4,8,16,32")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--no-recovery", action="store_true", help="leave out the run with a node killed")
    ap.add_argument("--lease-steps", default="auto",
                    help="control.lease_steps to run each N with, comma-separated (auto, the default: "
                         "about a second of steps a lease; 1: every step driven); "
                         "N-end: each lease granted once the last one's results are in (control.renew_early "
                         "false), not while it runs")
    ap.add_argument("--memory-every", default="auto",
                    help="checkpoint.memory_every (a lease ends at each snapshot step)")
    ap.add_argument("--pp", type=int, default=1, choices=(1, 2),
                    help="pipeline stages (2: dp=N/2 x pp=2, the surviving pipelines' groups carried)")
    ap.add_argument("--no-keep-groups", action="store_true",
                    help="failure.keep_groups false: a recovery builds every group anew")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "control_plane.json"))
    args = ap.parse_args()
    from elastic_trainer.data.corpus import prepare_stdlib_corpus

    corpus = os.path.join(tempfile.mkdtemp(), "stdlib")
    prepare_stdlib_corpus(corpus, 16, max_bytes=256 << 10)
    memory_every = args.memory_every if args.memory_every == "auto" else int(args.memory_every)
    leases = args.lease_steps.split(",")
    for spec in leases:
        lease_spec(spec)
    rows = []
    for n in [int(x) for x in args.workers.split(",")]:
        for lease in leases:
            print(f"N = {n}, lease_steps {lease} ...", flush=True)
            row = run_one(n, args.steps, args.warmup, corpus, kill=False, lease=lease, memory_every=memory_every,
                          pp=args.pp, keep_groups=not args.no_keep_groups)
            if not args.no_recovery:
                row["recovery"] = run_one(n, args.steps, args.warmup, corpus, kill=True, lease=lease,
                                          memory_every=memory_every, pp=args.pp,
                                          keep_groups=not args.no_keep_groups).get("recovery")
            rows.append(row)
            print(json.dumps(row), flush=True)
    fits = {}
    for lease in leases:
        sub = [r for r in rows if r["lease_steps"] == lease]
        xs = [r["workers"] for r in sub]
        tag = "" if len(leases) == 1 else f"lease{lease}_".replace("-", "_")
        for key in ("controller_s_mean", "controller_share_of_step", "grant_wait_s_mean",
                    "controller_cpu_s_per_step", "controller_cpu_share",
                    "beyond_compute_s_mean", "calls_per_step"):
            ys = [r[key] for r in sub]
            if all(y is not None for y in ys) and len(xs) >= 2:
                fits[tag + key] = fit(xs, ys)
        if not args.no_recovery and all(r.get("recovery") for r in sub) and len(xs) >= 2:
            for phase in ("detect_s", "replan_s", "restore_s", "rendezvous_s", "total_s"):
                fits[f"{tag}recovery_{phase}"] = fit(xs, [r["recovery"][phase] for r in sub])
    print(f"\nsnapshots: checkpoint.memory_every {memory_every}")
    print("\n| N | lease | controller ms/step (mean; median, p90; share of the step) | of it, waiting for a grant | controller CPU ms/step (share of a core) | beyond compute ms/step | step ms | calls/step | snapshot steps | recovery s (detect, re-plan, restore, of it rendezvous, total) | groups carried / built |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rec = r.get("recovery") or {}
        rs = ", ".join(f"{rec[k]:.2f}" for k in ("detect_s", "replan_s", "restore_s", "rendezvous_s", "total_s")) if rec else "-"
        rs += f" | {rec.get('groups_carried')} / {rec.get('groups_built')}" if rec else " | -"
        print(f"| {r['workers']} | {r['lease_steps']} | {r['controller_s_mean'] * 1e3:.2f}; "
              f"{r['controller_s_median'] * 1e3:.2f}, {r['controller_s_p90'] * 1e3:.2f}; "
              f"{r['controller_share_of_step']:.2%} | "
              f"{r['grant_wait_s_mean'] * 1e3:.2f} | "
              f"{r['controller_cpu_s_per_step'] * 1e3:.2f} ({r['controller_cpu_share']:.1%}) | "
              f"{r['beyond_compute_s_mean'] * 1e3:.2f} | "
              f"{r['step_s_median'] * 1e3:.1f} | {r['calls_per_step']:.2f} | {r['snapshot_steps']} | {rs} |")
    print("\n| figure | fit | at 1,000 | at 10,000 |")
    print("|---|---|---|---|")
    for key, f in fits.items():
        print(f"| {key} | {f['form']}: a={f['a']:.4g}, b={f['b']:.4g} | {f['at_1000']:.4g} | {f['at_10000']:.4g} |")
    parts = [(r["workers"], (r.get("recovery") or {}).get("group_parts")) for r in rows]
    if any(p for _, p in parts):
        print("\nthe recovery's groups by part, slowest rank, s (meet: store and arrival; check: carried groups)")
        for n, p in parts:
            print(f"  N={n}: " + ", ".join(f"{k} {v:.3f}" for k, v in (p or {}).items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "fits": fits}, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
