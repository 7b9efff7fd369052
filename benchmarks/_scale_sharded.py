"""Part of ``benchmarks/scale.py --sharded``: the optimizer sharded (ZeRO-2) against whole, at one size.

Interleaved runs of ``parallel.shard_optimizer`` none and gradients at dp=2 x pp=2 (snapshots as
the defaults take them): steady step time and each run's peak worker RSS; then a node killed
mid-run under each (snapshots every step), timed as ``recovery`` times it, with the bytes restored
against the bytes a full re-gather of every rank's state would move; and from the planner's
memory model, the largest GPT of the size's width that fits ``--cap-gb`` a worker each way.
"""

from __future__ import annotations

import statistics

MODES = ("none", "gradients")


def sharded_runs(size: tuple[int, int], args, size_config, fit, steady, recovery, kill_cluster) -> dict:
    """See the module docstring; ``kill_cluster``: ``(cluster, nodes)`` to kill a node of, re-added after."""
    n_layer, d_model = size
    out: dict = {m: {"step_s": [], "peak_rss_mb": []} for m in MODES}
    for i in range(args.rounds):
        for mode in MODES:
            print(f"{n_layer}x{d_model}: shard_optimizer {mode}, round {i + 1}/{args.rounds} ...", flush=True)
            ck = {"memory_every": 10**9} if args.sharded_no_snapshots else {}
            raw = size_config(n_layer, d_model, args.steps, f"scale-shard-{mode}{i}", args, ck)
            raw["parallel"] = {**raw.get("parallel", {}), "dp": 2, "pp": 2, "shard_optimizer": mode}
            res = fit(raw)
            out[mode]["step_s"].append(steady(res["result"].history))
            out[mode]["peak_rss_mb"].append(res["peak_rss_mb"])
    if args.rounds:   # --rounds 0: the recoveries alone
        for mode in MODES:
            out[mode]["step_median_s"] = statistics.median(out[mode]["step_s"])
        out["step_ratio"] = out["gradients"]["step_median_s"] / out["none"]["step_median_s"]
    if not args.skip_recovery:
        cluster, nodes = kill_cluster
        for i in range(args.recovery_rounds):
            for mode in MODES:
                print(f"{n_layer}x{d_model}: shard_optimizer {mode}, kill one node, round {i + 1} ...", flush=True)
                raw = size_config(n_layer, d_model, args.steps, f"scale-shard-kill-{mode}{i}", args,
                                  {"memory_every": 1})
                raw["parallel"] = {**raw.get("parallel", {}), "dp": 2, "pp": 2, "shard_optimizer": mode}
                out[mode].setdefault("recoveries", []).append(
                    recovery(fit(raw, kill={"cluster": cluster, "nodes": nodes, "at": args.kill_at or args.steps // 2})))
                nodes.append(cluster.add_node(num_cpus=1, object_store_memory=args.object_store_bytes))
                cluster.wait_for_nodes()
        for mode in MODES:
            recs = out[mode]["recoveries"]
            out[mode]["recovery"] = {k: statistics.median(r[k] for r in recs)
                                     for k in ("kill_to_first_step_s", "kill_to_detect_s", "replan_s", "restore_s",
                                               "first_step_s", "steps_redone", "restore_bytes",
                                               "restore_regather_bytes")}
        out["recovery_ratio"] = (out["gradients"]["recovery"]["kill_to_first_step_s"]
                                 / out["none"]["recovery"]["kill_to_first_step_s"])
    out["largest"] = largest_fitting(d_model, args.cap_gb, args, size_config)
    return out


def largest_fitting(d_model: int, cap_gb: float, args, size_config) -> dict:
    """The most layers of width ``d_model`` whose dp=2 x pp=2 fits ``cap_gb`` a worker by the
    planner's memory model, whole and sharded, with the bytes the heaviest rank needs each way."""
    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.planning.plan import make_plan
    from elastic_trainer.planning.policy import cut_fits, rank_estimates

    bound = cap_gb * (1 << 30)
    found: dict = {}
    for mode in MODES:
        best = None
        for n_layer in range(2, 257, 2):
            raw = size_config(n_layer, d_model, 1, "fits", args, {})
            raw["parallel"] = {"dp": 2, "pp": 2, "shard_optimizer": mode}
            cfg = TrainerConfig.model_validate(raw)
            plan = make_plan(cfg)
            if not cut_fits(cfg, 2, 2, plan.stage_bounds, bound):
                break
            need = max(r["bounded"] for r in rank_estimates(cfg, 2, 2, plan.stage_bounds))
            best = {"n_layer": n_layer, "params": sum(plan.stage_params), "need_bytes": need}
        found[mode] = best
    return found


def report(size: tuple[int, int], doc: dict, cap_gb: float) -> list[tuple[str, bool | None]]:
    """Print the table; the targets checked."""
    print(f"\n| {size[0]}x{size[1]} dp=2 x pp=2 | step ms (median; rounds) | peak worker RSS MB (rounds) "
          f"| kill -> first step s (median; rounds) | detect / restore / first step s | steps redone "
          f"| restored MB (of a full re-gather) |")
    print("|---|---|---|---|---|---|---|")
    for mode in MODES:
        r = doc[mode]
        rec = r.get("recovery") or {}
        steps = ", ".join(f"{s * 1e3:.0f}" for s in r["step_s"])
        rss = ", ".join(f"{m:.0f}" for m in r["peak_rss_mb"] if m is not None)
        rb, full = rec.get("restore_bytes"), rec.get("restore_regather_bytes")
        rounds = ", ".join(f"{x['kill_to_first_step_s']:.2f}" for x in r.get("recoveries", []))
        parts = " / ".join(f"{rec.get(k, float('nan')):.2f}" for k in ("kill_to_detect_s", "restore_s", "first_step_s"))
        step = f"{r['step_median_s'] * 1e3:.0f} ({steps})" if "step_median_s" in r else "n/a"
        print(f"| shard_optimizer {mode} | {step} | {rss} | "
              f"{rec.get('kill_to_first_step_s', float('nan')):.2f} ({rounds}) | {parts} | "
              f"{rec.get('steps_redone', 'n/a')} | {'n/a' if rb is None else f'{rb / 1e6:.1f}'}"
              f"{'' if not full else f' ({full / 1e6:.1f})'} |")
    big = doc["largest"]
    print(f"\nlargest GPT of this width at dp=2 x pp=2 within {cap_gb:g} GiB a worker (planner's memory model): "
          + "; ".join(f"{m}: {b['n_layer']} layers, {b['params'] / 1e6:.1f}M params" if b else f"{m}: none"
                      for m, b in big.items()))
    checks = ([(f"sharded step <= 1.10x whole ({doc['step_ratio']:.2f}x)", doc["step_ratio"] <= 1.10)]
              if "step_ratio" in doc else [])
    if "recovery_ratio" in doc:
        checks.append((f"sharded recovery <= 1.3x whole ({doc['recovery_ratio']:.2f}x)", doc["recovery_ratio"] <= 1.3))
    return checks
