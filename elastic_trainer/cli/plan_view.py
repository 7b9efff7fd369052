"""``elastic-trainer plan``: every layout priced, the one a re-plan takes, and memory per rank."""

from __future__ import annotations

import json
import sys

from ..config import TrainerConfig
from ..errors import ConfigError


def cmd_plan(args) -> int:
    """`elastic-trainer plan`: the predicted layouts, the re-plan, and the configured layout's memory per rank."""
    from ..models.build import whole_build_warning
    from ..planning.constants import load_constants
    from ..planning.plan import make_plan
    from ..planning.planner import format_candidates, predict_candidates, recommend
    from ..planning.policy import rank_estimates, replan_row

    cfg = TrainerConfig.from_yaml(args.job, args.set)
    whole = whole_build_warning(cfg.model)
    if whole:
        print(f"warning: {whole}", file=sys.stderr)
    plan = make_plan(cfg)
    out = plan.describe()
    out.pop("rank_nodes")
    out["micro_batches_per_replica"] = cfg.micro_batches
    out["schedule"] = cfg.parallel.schedule
    out["backend"] = cfg.scaling.resolved_backend()
    workers = cfg.world_size if args.workers is None else args.workers
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1; got {workers}")
    gb = cfg.scaling.worker_memory_gb if args.memory_gb is None else args.memory_gb
    if gb is not None and not gb > 0:
        raise ConfigError(f"--memory-gb must be > 0; got {gb}")
    memory = None if gb is None else gb * (1 << 30)
    path = args.constants or cfg.comm.constants
    constants = load_constants(path) if path else None
    # A constants file may also carry the compute rate of its machine (see planner.predict_candidates).
    rows = predict_candidates(cfg, workers, constants, (constants or {}).get("compute"), worker_memory_bytes=memory)
    best, reason = recommend(rows)
    # What a run of this job would re-plan to on these workers after a failure: same model, same rows,
    # but the run keeps its codec and sync (planning.policy.choose_plan picks the same).
    replan = replan_row(rows, cfg)
    topo = plan.topology
    out["memory_per_rank"] = rank_estimates(cfg, topo.dp, topo.pp, plan.stage_bounds)
    if args.json:
        # The plan's own keys stay at the top level, as before predictions existed.
        out["predictions"] = {"workers": workers, "constants": rows[0]["constants_source"] if rows else None,
                              "worker_memory_bytes": memory, "candidates": rows, "recommended": best,
                              "reason": reason, "replan": replan}
        print(json.dumps(out, indent=2))
        return 0
    print(format_candidates(rows))
    print()
    print(f"recommended: {reason}")
    if replan is not None:
        print(f"re-plan after a failure on {workers} worker(s), keeping compression {cfg.comm.compression} and sync "
              f"{cfg.comm.sync}: dp={replan['dp']} pp={replan['pp']}, predicted {replan['total_s'] * 1e3:.1f} "
              f"ms/step, {replan['memory_bytes'] / 1e6:.1f} MB/worker")
    if constants is None and (cfg.scaling.uses_gpu or out["backend"] == "nccl"):
        print("caution: the built-in constants, compute rate and codec costs are one CPU thread and gloo over "
              "loopback; for this GPU job give --constants FILE with your own alpha/beta and a 'compute' entry")
    print()
    print(format_rank_memory(out.pop("memory_per_rank"), cfg, gb))
    print()
    print("the job as configured:")
    print(json.dumps(out, indent=2))
    return 0


def format_rank_memory(ranks: list[dict], cfg, gb: float | None) -> str:
    """The configured layout's memory per pipeline rank, buffer by buffer, in MiB."""
    mib = lambda n: f"{n / (1 << 20):.1f}"  # noqa: E731
    where = "device" if cfg.scaling.uses_gpu else "host (CPU workers: one memory)"
    bound = f"{gb:g} GiB" if gb else "none set (a run takes what a worker has)"
    lines = [f"memory per rank as configured, MiB (bound: {bound}; held to it: {where}):",
             " rank  weights    grads  optimizer  buckets  comm_state  activations (in flight x per micro-batch)"
             "  snapshots  process   device     host"]
    for r in ranks:
        flight = r["micro_batches_in_flight"]
        acts = f"{mib(r['activations'])} ({flight} x {mib(r['activation_per_micro_batch'])})" if flight else \
            mib(r["activations"])
        lines.append(f"{r['rank']:>5} {mib(r['weights']):>8} {mib(r['grads']):>8} {mib(r['optimizer']):>10} "
                     f"{mib(r['grad_buckets']):>8} {mib(r['comm_state']):>11}  {acts:<41} "
                     f"{mib(r['snapshots']):>10} {mib(r['runtime']):>8} {mib(r['device']):>8} {mib(r['host']):>8}")
    store = max(r["object_store"] for r in ranks)
    lines.append(f"(besides: up to {mib(store)} MiB of a rank's snapshot parts in other nodes' object stores: "
                 "(checkpoint.replicas - 1) x snapshots_kept copies)")
    return "\n".join(lines)
