"""Gradient communication: measured step time and bytes of every codec and sync mode vs the planner's prediction.

Three parts, each usable alone:

1. sweep: ring, tree and chunked all-reduce over ``--procs`` local gloo
   processes (``elastic_trainer.planning.calibration.run_sweep``), their peak busbw
   against one loopback TCP stream (the most a link on this machine can
   carry), and the fitted alpha/beta per algorithm. Runs before the Ray
   cluster starts so the two never share the cores.
2. training: the demo GPT (jobs/demo.yaml) at dp=4 x pp=1 on a 4-node
   simulated cluster (``ray.cluster_utils.Cluster``, one CPU per node),
   ``--steps`` steps per run, snapshots off, for each compression (none,
   fp16, bf16, int8, topk, powersgd; sync allreduce) and each other sync mode
   (local_sgd, diloco, parameter_server; uncompressed). Per run, from
   ``result.history`` after ``--warmup`` steps: median step time, and the
   medians of comm_bytes (the sum over ranks; per rank = / 4), comm_s and
   exposed_comm_s (absent keys are reported as null). local_sgd and diloco
   average the model once every ``local_steps`` steps, so their step time
   is also taken as the mean over whole windows of local_steps steps: that
   is what a prediction of comm / local_steps per step is held against.
3. prediction: ``planner.predict_candidates`` for the same config, with the
   alpha/beta fitted in part 1 (else the planner's built-in ones), and two
   calibrations taken on the cluster of part 2 before its runs:
   - compute: the demo GPT's forward + backward and AdamW in plain torch,
     one thread, in one Ray task alone, then in one task per node all at
     once. Four workers on two cores get less than two cores' worth (shared
     caches, switching, Ray's own processes), so the planner's ``cpus`` is
     the cores they effectively get: ``4 * alone / together``;
   - the parameter server's path: every node sends N bytes (256 KiB to
     8 MiB) to an actor on the head node and gets N bytes back, all at once;
     ``cost_model.fit(..., "ps", shards=1)`` gives the ``ps`` alpha/beta
     (bench-comm, which starts no Ray, can only derive them from the ring's).
   - the step's own overhead: a run of the demo that never communicates;
     its median step minus the predicted compute is the planner's
     ``step_overhead_s`` (the local SGD and DiLoCo rows run nearly the same,
     so they are not independent of it).
   Reported: ``|pred - meas| / meas`` per run; the target is within 25%.

Prints markdown tables and writes benchmarks/results/comm.json. Run on a
quiet machine:

    python benchmarks/comm.py                      # everything, 40 steps per run, first 10 skipped
    python benchmarks/comm.py --only-sweep         # part 1 only
    python benchmarks/comm.py --only-topk          # the two top-k exchanges at dp = 2, 4, 8
    python benchmarks/comm.py --skip-sweep --steps 60 --warmup 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NODES = 4
DP = 4
TARGET = 0.25
RUNS = ([(c, "allreduce") for c in ("none", "fp16", "bf16", "int8", "topk", "powersgd")]
        + [("none", s) for s in ("local_sgd", "diloco", "parameter_server")])


def demo_config(steps: int, name: str, compression: str, sync: str) -> dict:
    import yaml

    raw = yaml.safe_load((ROOT / "jobs" / "demo.yaml").read_text())
    raw["train"]["steps"] = steps
    raw["run"] = {"name": name, "log_every": 10_000, "report_dir": None}
    raw["data"]["path"] = os.path.abspath(os.path.expanduser(raw["data"]["path"]))
    raw["parallel"] = {"dp": DP, "pp": 1}
    # Snapshots are not what is measured here; the planner leaves them out too.
    raw["checkpoint"] = {"memory_every": 10**9}
    raw["comm"] = {**raw.get("comm", {}), "compression": compression, "sync": sync}
    return raw


# -- part 1 -----------------------------------------------------------------------------------------
def run_sweep_part(procs: int, max_size: str, iters: int) -> dict:
    from elastic_trainer.planning import calibration as bench, cost_model

    max_bytes = bench.parse_size(max_size)
    sizes = cost_model.size_range(1 << 10, max_bytes)
    print(f"sweep: ring, tree, chunked on {procs} processes, {len(sizes)} sizes up to {max_bytes >> 20} MiB, "
          f"{iters} iterations ...", flush=True)
    t0 = time.perf_counter()
    rows = bench.run_sweep(procs, sizes, ("ring", "tree", "chunked"), iters)
    fits = bench.fit_constants(rows)
    print("loopback TCP stream ...", flush=True)
    loopback = bench.loopback_throughput()
    doc = bench.constants_document(
        rows, fits, loopback, procs=procs, backend="gloo",
        command=f"python benchmarks/comm.py --procs {procs} --max {max_size} --iters {iters}")
    print(bench.format_table(rows))
    return {"rows": rows, "constants": doc, "loopback": loopback, "peak_busbw_Bps": bench.peak_busbw(rows),
            "seconds": time.perf_counter() - t0}


# -- part 2 -----------------------------------------------------------------------------------------
def _compute_loop(steps: int, start_at: float | None = None) -> tuple[float, float, int, int]:
    """(median forward+backward s, median AdamW s, params, tokens) of the demo GPT, one torch thread,
    one replica's batch at dp=4; timed from wall-clock ``start_at`` if given (so that
    several copies run at the same time)."""
    import torch
    from torch import nn

    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.models import build_model

    torch.set_num_threads(1)
    cfg = TrainerConfig.model_validate(demo_config(1, "calib", "none", "allreduce"))
    blocks, loss_fn = build_model(cfg.model, cfg.train.seed)
    model = nn.Sequential(*blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = sum(p.numel() for p in model.parameters())
    mb, seq = cfg.train.micro_batch_size, cfg.data.seq_len
    m = cfg.micro_batches
    gen = torch.Generator().manual_seed(0)
    fb, os_ = [], []
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))
    for _ in range(steps + 2):
        opt.zero_grad()
        t0 = time.perf_counter()
        for _ in range(m):
            x = torch.randint(0, cfg.model.vocab_size, (mb, seq), generator=gen)
            loss_fn(model(x), x).backward()
        t1 = time.perf_counter()
        opt.step()
        fb.append(t1 - t0)
        os_.append(time.perf_counter() - t1)
    # The first two steps allocate and warm caches.
    return statistics.median(fb[2:]), statistics.median(os_[2:]), params, m * mb * seq


def _ship_this_module() -> None:
    """Ray workers cannot import this file (benchmarks/ is not a package on their path):
    when it is imported rather than run, send its functions by value."""
    if __name__ != "__main__":
        import ray.cloudpickle

        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def measure_compute(steps: int = 8) -> dict:
    """One thread, plain torch, nothing else running: the demo GPT's forward + backward of
    one replica's batch at dp=4, and AdamW. Returns the planner's ``compute`` dict; its
    ``cpus`` (the machine's count) is replaced by :func:`measure_colocated`'s figure."""
    seconds, opt_s, params, tokens = _compute_loop(steps)
    return {"seconds": seconds, "params": params, "tokens": tokens, "optimizer_s_per_param": opt_s / params,
            "cpus": os.cpu_count()}


def measure_colocated(compute: dict, steps: int = 30) -> tuple[dict, dict]:
    """The loop of :func:`measure_compute` as Ray tasks on the simulated nodes: first one task
    alone, then one per node all at once, as the training runs place their workers (with
    Ray's own processes running beside them).

    The planner stretches a worker's compute by ``workers / cpus``; four workers
    sharing two cores run slower than half speed (shared caches, switching,
    Ray's own processes), so ``cpus`` becomes the cores they effectively get,
    ``workers * alone / together``, and ``seconds`` the time alone in a Ray
    worker. Returns ``compute`` so updated, and the raw figures.
    """
    import ray

    _ship_this_module()
    probe = ray.remote(num_cpus=1)(_compute_loop)
    alone = ray.get(probe.remote(steps))
    # Every copy starts at the same moment, once all are placed and imported.
    start_at = time.time() + 5.0
    together = ray.get([probe.remote(steps, start_at) for _ in range(NODES)])
    fb_alone, opt_alone = alone[0], alone[1]
    fb_together = statistics.median(t[0] for t in together)
    effective = NODES * fb_alone / fb_together
    return ({**compute, "seconds": fb_alone, "optimizer_s_per_param": opt_alone / compute["params"],
             "cpus": round(min(float(os.cpu_count() or 1), effective), 3)},
            {"workers": NODES, "seconds_alone": fb_alone, "seconds_together": fb_together,
             "seconds_alone_outside_ray": compute["seconds"], "machine_cpus": os.cpu_count()})


def measure_step_overhead(compute: dict, steps: int, warmup: int) -> dict:
    """What a step costs besides forward, backward, the optimizer and communication (reading
    the batch, dispatching the step, Python): the demo at dp=4 for ``steps`` steps without
    any communication (local SGD whose first meeting lies past the end), its median step
    after ``warmup`` minus the planner's compute for it. The local SGD and DiLoCo rows run
    nearly this, so their predictions are not independent of it; the others are."""
    from elastic_trainer import Trainer, TrainerConfig
    from elastic_trainer.planning.planner import predict_candidates

    raw = demo_config(steps, "calib-overhead", "none", "local_sgd")
    raw["comm"]["local_steps"] = steps + 1
    cfg = TrainerConfig.model_validate(raw)
    measured = statistics.median(r["step_time_s"] for r in Trainer(cfg, verbose=False).fit().history[warmup:])
    [row] = [r for r in predict_candidates(cfg, DP, None, compute)
             if (r["dp"], r["pp"], r["sync"]) == (DP, 1, "local_sgd")]
    return {"measured_step_s": measured, "predicted_compute_s": row["compute_s"],
            "step_overhead_s": max(0.0, measured - row["compute_s"])}


def measure_ps_transport(sizes=(1 << 18, 1 << 20, 1 << 22, 1 << 23), iters: int = 8) -> dict:
    """Alpha-beta of the parameter server's data path, through Ray: one task per simulated node
    sends an array of N bytes to an actor on the head node (where the shards live) and gets
    N bytes back, all nodes at once, as a push and a pull of every replica do.

    The planner prices a parameter-server step as ``2 alpha + 2 * dp * N * beta`` (the head
    node's link carries every replica's push and pull), so that is what is fitted.
    """
    import numpy as np
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from elastic_trainer.planning import cost_model

    _ship_this_module()

    @ray.remote(num_cpus=0)
    class Echo:
        def echo(self, a):
            return np.array(a)  # a copy, as a shard's pull returns its own arrays

    @ray.remote(num_cpus=1)
    def client(echo, sizes, iters, start_at):
        time.sleep(max(0.0, start_at - time.time()))
        out = {}
        for n in sizes:
            a = np.ones(n, dtype=np.uint8)
            times = []
            for _ in range(iters + 1):
                t0 = time.perf_counter()
                ray.get(echo.echo.remote(a))
                times.append(time.perf_counter() - t0)
            out[n] = statistics.median(times[1:])
        return out

    head = ray.get_runtime_context().get_node_id()
    echo = Echo.options(scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)).remote()
    # Sizes above Ray's inline limit (100 KiB), which a replica's gradients are; all clients at once.
    start_at = time.time() + 5.0
    per_client = ray.get([client.remote(echo, list(sizes), iters, start_at) for _ in range(NODES)])
    rows = [{"size": n, "time_s": statistics.median(c[n] for c in per_client)} for n in sizes]
    # The planner's parameter-server row: cost_model "ps" with every replica on one server.
    f = cost_model.fit([(r["size"], r["time_s"]) for r in rows], "ps", p=NODES, relative=True, shards=1)
    return {"alpha_s": max(0.0, f.alpha), "beta_s_per_byte": max(0.0, f.beta), "rows": rows,
            "derived_from": f"Ray echo: {NODES} nodes x N bytes to an actor on the head node and back"}


def steady_stats(history: list[dict], warmup: int, local_steps: int | None) -> dict:
    recs = history[warmup:]
    if not recs:
        raise RuntimeError(f"the run recorded {len(history)} steps, none after the {warmup} warm-up steps")

    def med(key):
        vals = [r[key] for r in recs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    out = {"steps": len(recs), "median_step_s": med("step_time_s"),
           "mean_step_s": statistics.fmean(r["step_time_s"] for r in recs),
           "comm_bytes_total": med("comm_bytes"), "comm_s": med("comm_time_s"), "exposed_comm_s": med("exposed_comm_s")}
    out["comm_bytes_per_rank"] = None if out["comm_bytes_total"] is None else out["comm_bytes_total"] / DP
    if local_steps:
        # Whole windows only: each holds exactly one model average.
        n = len(recs) // local_steps * local_steps
        if n:
            out["window_mean_step_s"] = statistics.fmean(r["step_time_s"] for r in recs[:n])
            out["window_mean_comm_bytes_per_rank"] = statistics.fmean(r.get("comm_bytes") or 0 for r in recs[:n]) / DP
    return out


def start_cluster(head_cpus: float):
    import ray
    from ray.cluster_utils import Cluster

    from elastic_trainer import TrainerConfig
    from elastic_trainer.data.dataset import ensure_prepared

    ensure_prepared(TrainerConfig.model_validate(demo_config(1, "prep", "none", "allreduce")).data)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "include_dashboard": False})
    for _ in range(NODES):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    return cluster


def run_training_part(steps: int, warmup: int, runs) -> list[dict]:
    from elastic_trainer import Trainer, TrainerConfig

    out = []
    for i, (compression, sync) in enumerate(runs):
        print(f"run {i + 1}/{len(runs)}: compression={compression} sync={sync} ...", flush=True)
        raw = demo_config(steps, f"comm-{compression}-{sync}-{i}", compression, sync)
        rec = {"compression": compression, "sync": sync}
        try:
            cfg = TrainerConfig.model_validate(raw)
            local = cfg.comm.local_steps if sync in ("local_sgd", "diloco") else None
            if compression == "powersgd" and warmup < cfg.comm.powersgd_start_step:
                raise ValueError(f"--warmup {warmup} < comm.powersgd_start_step "
                                 f"({cfg.comm.powersgd_start_step}): the steady state would include plain "
                                 "all-reduce steps")
            result = Trainer(cfg, verbose=False).fit()
            rec.update(steady_stats(result.history, warmup, local))
        except Exception as e:  # one mode not wired yet must not cost the others their numbers
            rec["error"] = f"{type(e).__name__}: {e}"
            print(f"  failed: {rec['error']}", flush=True)
            traceback.print_exc()
        out.append(rec)
    return out


# -- part 3 -----------------------------------------------------------------------------------------
def add_predictions(runs: list[dict], steps: int, constants: dict | None, compute: dict | None) -> None:
    from elastic_trainer.planning.planner import predict_candidates
    from elastic_trainer.config import TrainerConfig

    # One prediction covers every codec and sync mode: the rows differ only in which is "configured". The
    # plain config also validates while a mode is not yet accepted by the config.
    cfg = TrainerConfig.model_validate(demo_config(steps, "predict", "none", "allreduce"))
    rows = predict_candidates(cfg, DP, constants, compute)
    for rec in runs:
        [row] = [r for r in rows if (r["dp"], r["pp"], r["compression"], r["sync"])
                 == (DP, 1, rec["compression"], rec["sync"])]
        rec["predicted"] = {k: row[k] for k in ("total_s", "compute_s", "dp_comm_s", "codec_s", "hidden_s",
                                                "exposed_comm_s", "comm_bytes")}
        measured = rec.get("window_mean_step_s") or rec.get("median_step_s")
        if measured:
            rec["measured_step_s"] = measured
            rec["rel_error"] = abs(row["total_s"] - measured) / measured
            rec["within_target"] = rec["rel_error"] <= TARGET


# -- report -----------------------------------------------------------------------------------------
def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.3f}"


def print_sweep(sweep: dict, runs: list[dict] | None = None, ps_fit: dict | None = None) -> None:
    lb = sweep["loopback"]["bytes_per_s"]
    fits = sweep["constants"]["algorithms"]
    print(f"\n### All-reduce on {sweep['constants']['procs']} local processes vs one loopback TCP stream "
          f"({lb / 1e9:.2f} GB/s)\n")
    print("| algorithm | peak busbw (GB/s) | x loopback | fitted alpha (us) | fitted bandwidth (GB/s) | residual |")
    print("|---|---|---|---|---|---|")
    for name, bw in sweep["peak_busbw_Bps"].items():
        f = fits[name]
        print(f"| {name} | {bw / 1e9:.3f} | {bw / lb:.2f} | {f['alpha_s'] * 1e6:.1f} | "
              f"{f['bandwidth_Bps'] / 1e9:.3f} | {f['relative_residual']:.2f} |")
    ps = next((r for r in runs or [] if r.get("sync") == "parameter_server" and r.get("comm_s")), None)
    fit = (f"{ps_fit['alpha_s'] * 1e6:.1f} | {1 / ps_fit['beta_s_per_byte'] / 1e9:.3f} | (Ray echo) |"
           if ps_fit and ps_fit["beta_s_per_byte"] > 0 else "ring's | ring's | |")
    if ps:
        # Measured in training: the bytes one replica pushes and pulls per step over its time in push_pull.
        bw = ps["comm_bytes_per_rank"] / ps["comm_s"]
        print(f"| ps (in training, push+pull via Ray) | {bw / 1e9:.3f} | {bw / lb:.2f} | {fit}")
    else:
        print(f"| ps | (not measured: run the parameter_server training row) | | {fit}")


def print_runs(runs: list[dict]) -> None:
    print(f"\n### demo GPT, dp={DP} x pp=1 on {NODES} simulated nodes: measured vs predicted\n")
    print("| compression | sync | median step (ms) | compared (ms) | predicted (ms) | error | within 25% "
          "| comm MB/step/rank (meas) | (pred) | comm_s (ms) | exposed (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        p = r.get("predicted", {})
        if "error" in r:
            print(f"| {r['compression']} | {r['sync']} | failed: {r['error'][:60]} | | {_ms(p.get('total_s'))} "
                  f"| | | | {_mb(p.get('comm_bytes'))} | | |")
            continue
        err = r.get("rel_error")
        print(f"| {r['compression']} | {r['sync']} | {_ms(r.get('median_step_s'))} | {_ms(r.get('measured_step_s'))} "
              f"| {_ms(p.get('total_s'))} | {'-' if err is None else f'{err * 100:.0f}%'} "
              f"| {'-' if err is None else ('yes' if r['within_target'] else 'no')} "
              f"| {_mb(r.get('comm_bytes_per_rank'))} | {_mb(p.get('comm_bytes'))} | {_ms(r.get('comm_s'))} "
              f"| {_ms(r.get('exposed_comm_s'))} |")
    print("\n(compared: the median step, or for local_sgd / diloco the mean over whole local_steps windows; "
          "measured comm bytes are history's sum over ranks / 4)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the statistics (>= powersgd_start_step)")
    ap.add_argument("--procs", type=int, default=4, help="processes of the all-reduce sweep")
    ap.add_argument("--max", default="256MiB", help="largest sweep message")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per sweep size")
    ap.add_argument("--only-sweep", action="store_true", help="part 1 only")
    ap.add_argument("--only-topk", action="store_true",
                    help="only the two top-k exchanges at dp = 2, 4, 8 (bytes per rank, seconds per step; "
                         "writes benchmarks/results/topk_exchange.json)")
    ap.add_argument("--skip-sweep", action="store_true", help="no sweep: predict with --constants or the built-ins")
    ap.add_argument("--constants", help="with --skip-sweep: a bench-comm --out file")
    ap.add_argument("--runs", help="comma-separated compression:sync pairs, default all nine")
    ap.add_argument("--head-cpus", type=float, default=0,
                    help="CPUs of the head node; the workers take the 4 one-CPU nodes, and the controller and "
                         "parameter-server shards ask for no CPU, so 0 (the default) fits")
    args = ap.parse_args()
    if args.only_topk:
        from _topk_exchange import measure, print_rows

        rows = measure()
        print_rows(rows)
        (ROOT / "benchmarks" / "results" / "topk_exchange.json").write_text(json.dumps(rows, indent=1) + "\n")
        return
    if args.only_sweep and args.skip_sweep:
        ap.error("--only-sweep and --skip-sweep leave nothing to do")
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} must be below --steps {args.steps}")
    runs = RUNS
    if args.runs:
        runs = [tuple(x.split(":", 1)) if ":" in x else (x, "allreduce") for x in args.runs.split(",")]

    out: dict = {"steps": args.steps, "warmup": args.warmup, "nodes": NODES, "dp": DP, "cpus": os.cpu_count(),
                 "target_rel_error": TARGET}
    constants = None
    if not args.skip_sweep:
        sweep = run_sweep_part(args.procs, args.max, args.iters)
        out["sweep"] = sweep
        constants = sweep["constants"]
    elif args.constants:
        from elastic_trainer.planning.constants import load_constants

        constants = load_constants(args.constants)
    if not args.only_sweep:
        import ray

        print("measuring the compute rate (plain torch, one thread) ...", flush=True)
        compute = measure_compute()
        cluster = start_cluster(args.head_cpus)
        try:
            print(f"measuring it again on {NODES} nodes at once, and the parameter server's path ...", flush=True)
            compute, colocated = measure_colocated(compute)
            ps = measure_ps_transport()
            print("measuring the step's own overhead (a run that does not communicate) ...", flush=True)
            overhead = measure_step_overhead(compute, args.steps, args.warmup)
            compute = {**compute, "step_overhead_s": overhead["step_overhead_s"]}
            records = run_training_part(args.steps, args.warmup, runs)
        finally:
            ray.shutdown()
            cluster.shutdown()
        out["compute"], out["compute_colocated"], out["ps_transport"] = compute, colocated, ps
        out["step_overhead"] = overhead
        from elastic_trainer.planning.constants import DEFAULT_CONSTANTS

        base = constants or DEFAULT_CONSTANTS
        constants = {**base, "algorithms": {**base["algorithms"],
                                            "ps": {k: ps[k] for k in ("alpha_s", "beta_s_per_byte", "derived_from")}}}
        out["constants_ps"] = constants["algorithms"]["ps"]
        add_predictions(records, args.steps, constants, compute)
        out["runs"] = records
        out["constants_used"] = "this sweep" if not args.skip_sweep else (args.constants or "planner built-ins")
        if "sweep" in out:
            print_sweep(out["sweep"], records, out.get("ps_transport"))
        print_runs(records)
        judged = [r for r in records if "rel_error" in r]
        if judged:
            ok = sum(r["within_target"] for r in judged)
            print(f"\n{ok} of {len(judged)} runs predicted within {TARGET:.0%}; "
                  f"median error {statistics.median(r['rel_error'] for r in judged) * 100:.0f}%")
    if "sweep" in out and args.only_sweep:
        print_sweep(out["sweep"])
    res = ROOT / "benchmarks" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / "comm.json").write_text(json.dumps(out, indent=1, default=str))
    print(f"\nwrote {res / 'comm.json'}")


if __name__ == "__main__":
    main()
