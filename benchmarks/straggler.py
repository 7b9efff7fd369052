"""A straggler's cost, and what `balance` does about it, on a 4-node simulated cluster.

The demo GPT (jobs/demo.yaml) at dp=2 x pp=2 on four one-CPU nodes; one
worker (rank 1 at the start) computes ``--factor`` times slower for the middle
third of the run (``inject_fault("slow_compute")``, on at step N/3, off at
2N/3). Reported per ``balance.mode`` (``off``, ``detect``, ``act``),
interleaved over ``--rounds``:

- tokens/s over the slow third and over the whole run, and the same run with
  no straggler (the baseline), so the throughput the straggler costs is
  ``baseline - off`` and a mitigation recovers ``(mode - off) / (baseline - off)``;
- with ``detect`` and ``act``: the step the straggler event named the rank and the
  step its recovery was seen, against when the slowdown began and ended; with
  ``act``, each ``rebalance`` (the micro-batches per replica it moved to).
- the figures behind each decision (``decisions`` per run, medians per mode in
  the table), which the integration tests leave to this benchmark since they
  hold only on a quiet host: the slowed rank's pace at its naming
  (``slow_pace``, its compute since the onset over its peers', against
  ``--factor``) and the steps from the slowdown to the naming; the first share
  move (predicted step against the measured one); a spare's predicted step,
  cost and payback in steps; and when it is let back in, how much faster its
  probe ran than when it was benched (``probe_speedup``, against ``--factor``).

Target (issue 17): ``act`` recovers at least 60% of the throughput lost. Run on
a quiet machine:

    python benchmarks/straggler.py                     # 90 steps, factor 2, 2 rounds
    python benchmarks/straggler.py --steps 150 --rounds 3
    # A straggler no share can help (one micro-batch per replica): left out as a spare, let back in
    python benchmarks/straggler.py --layout 2x1 --micro-batch 8 --factor 20 --no-ray-train \
        --set balance.payback_steps=5000 --set scaling.grow_check_s=0.5 --out benchmarks/results/straggler_spare.json

Writes benchmarks/results/straggler.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from recovery import demo_config, start_cluster  # noqa: E402  (the same cluster and job as the recovery benchmark)

MODES = ("off", "detect", "act")


# The fields of the straggler and rebalance events kept in the results.
EVENT_KEYS = ("kind", "action", "rank", "ranks", "worker", "step", "since_step", "pace", "slow_pace", "compute_s",
              "reference_s", "shares", "stages", "plan_after", "predicted_step_s", "step_s_before", "cost_s",
              "payback_steps", "probe_s", "probe_s_benched", "benched_steps", "rank_before", "reason")


def decisions(events: list[dict], worker: int | None, start: int, end: int) -> dict:
    """What ``balance`` decided about the slowed ``worker`` (slowed from step ``start`` to
    ``end``), each with its figures: the naming, its recovery, the first share move, the spare
    and its return. Keys are absent where that decision was not taken."""
    out: dict = {}

    def first(pred, after: int = -1):
        return next(((i, e) for i, e in enumerate(events) if i > after and pred(e)), (None, None))

    i, named = first(lambda e: e["kind"] == "straggler" and e.get("worker") == worker and e["step"] >= start)
    if named is None:
        return out
    out["named"] = {"step": named["step"], "since_step": named["since_step"],
                    "steps_after_start": named["step"] - start, "slow_pace": named.get("slow_pace"),
                    "compute_s": named.get("compute_s"), "reference_s": named.get("reference_s")}
    _, back = first(lambda e: e["kind"] == "straggler_recovered" and e["rank"] == named["rank"], i)
    if back is not None:
        out["recovered"] = {"step": back["step"], "steps_after_end": back["step"] - end}
    _, move = first(lambda e: e["kind"] == "rebalance" and e.get("action") == "shares"
                    and named["rank"] in (e.get("ranks") or []), i)
    if move is not None:
        out["shares"] = {k: move.get(k) for k in ("step", "shares", "predicted_step_s", "step_s_before")}
    j, spare = first(lambda e: e["kind"] == "rebalance" and e.get("action") == "spare"
                     and e["rank"] == named["rank"], i)
    if spare is not None:
        out["spare"] = {k: spare.get(k) for k in ("step", "pace", "predicted_step_s", "step_s_before", "cost_s",
                                                  "payback_steps", "plan_after")}
        _, readmit = first(lambda e: e["kind"] == "rebalance" and e.get("action") == "readmit"
                           and e.get("worker") == worker, j)
        if readmit is not None:
            speedup = (readmit["probe_s_benched"] / readmit["probe_s"]
                       if readmit.get("probe_s") and readmit.get("probe_s_benched") else None)
            out["readmit"] = {"step": readmit["step"], "steps_after_end": readmit["step"] - end,
                              "benched_steps": readmit.get("benched_steps"), "reason": readmit.get("reason"),
                              "probe_s": readmit.get("probe_s"), "probe_s_benched": readmit.get("probe_s_benched"),
                              "probe_speedup": speedup}
    return out


def run_once(steps: int, factor: float, mode: str, slow: bool, name: str, micro_batch: int,
             layout: tuple[int, int], plot: str | None = None, overrides: list[str] = ()) -> dict:
    import ray

    from elastic_trainer import Trainer, TrainerConfig
    from elastic_trainer.config.parsing import apply_overrides
    from elastic_trainer.naming import NAMESPACE

    raw = demo_config(steps, name, failure={"allow_fault_injection": True}, checkpoint={"memory_every": 10})
    raw = apply_overrides(raw, list(overrides))
    raw.setdefault("balance", {})["mode"] = mode
    # Shares move whole micro-batches, and 1F1B keeps pp of them per replica: the demo's own
    # micro-batch (2 per replica at dp=2) leaves nothing to move.
    raw["train"]["micro_batch_size"] = micro_batch
    raw["parallel"].update(dp=layout[0], pp=layout[1])
    start, end = steps // 3, 2 * steps // 3
    done: set = set()

    def set_factor(f: float) -> None:
        # The worker that started as rank 1: actors are named after their first rank.
        replica, stage = divmod(1, layout[1])
        ray.get(ray.get_actor(f"{name}-rank1-r{replica}s{stage}", namespace=NAMESPACE).inject_fault.remote(
            "slow_compute", seconds=f))

    def on_step(rec):
        if slow and rec["step"] >= start and "on" not in done:
            done.add("on")
            set_factor(factor)
        if slow and rec["step"] >= end and "off" not in done:
            done.add("off")
            set_factor(1.0)

    result = Trainer(TrainerConfig.model_validate(raw), verbose=False, on_step=on_step).fit()
    h = result.history
    if plot:
        from elastic_trainer.reporting.rank_file import read_rank_figures
        from elastic_trainer.reporting.report import write_report

        write_report(h, result.events, plot, title=f"{factor:g}x straggler on rank 1, steps {start}-{end}, "
                                                    f"balance.mode={mode}",
                     ranks=read_rank_figures(result.ranks_path) if result.ranks_path else None)
    gb_tokens = raw["train"]["global_batch_size"] * raw["data"]["seq_len"]
    middle = [r for r in h if start < r["step"] <= end]
    out = {
        "mode": mode, "slow": slow,
        "tokens_per_s": gb_tokens * len(h[3:]) / sum(r["step_time_s"] for r in h[3:]),
        "slow_third_tokens_per_s": gb_tokens * len(middle) / sum(r["step_time_s"] for r in middle),
        "median_step_s": statistics.median(r["step_time_s"] for r in h[3:]),
    }
    ev = [e for e in result.events if e["kind"] in ("straggler", "straggler_recovered", "rebalance")]
    out["events"] = [{k: e[k] for k in EVENT_KEYS if k in e} for e in ev]
    if slow:
        # The worker that started as rank 1 is the slowed one, whatever ranks later plans give it.
        out["decisions"] = decisions(ev, result.plans[0]["workers"].get(1), start, end)
    out["replans"] = [{"reason": r["reason"], "step": r["failed_step"], "steps_redone": r["steps_redone"],
                       "seconds": round(r.get("total_s") or 0.0, 3)} for r in result.recoveries]
    out["shares_by_step"] = {r["step"]: r["shares"] for r in h if r.get("shares")}
    out["slowdown"] = {"from_step": start, "to_step": end} if slow else None
    return out


def ray_train_once(steps: int, factor: float, slow: bool, micro_batch: int) -> dict:
    """Ray Train (TorchTrainer, DDP at dp=4, the throughput benchmark's loop) on the same
    slowdown: rank 1's passes ``factor`` times slower over the middle third. It waits."""
    from throughput import demo_config as ddp_config, run_ray_train

    raw = ddp_config(steps)
    raw["train"]["micro_batch_size"] = micro_batch
    start, end = steps // 3, 2 * steps // 3
    times = run_ray_train(raw, {"rank": 1, "factor": factor, "from": start, "to": end} if slow else None)
    gb_tokens = raw["train"]["global_batch_size"] * raw["data"]["seq_len"]
    middle = times[start:end]
    return {"mode": "ray_train", "slow": slow, "tokens_per_s": gb_tokens * len(times[3:]) / sum(times[3:]),
            "slow_third_tokens_per_s": gb_tokens * len(middle) / sum(middle),
            "median_step_s": statistics.median(times[3:]), "events": [],
            "slowdown": {"from_step": start, "to_step": end} if slow else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=90)
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=1, help="train.micro_batch_size (the demo's is 4)")
    ap.add_argument("--layout", default="2x2", help="dp x pp, as DPxPP (the demo's is 2x2)")
    ap.add_argument("--no-ray-train", action="store_true", help="leave out Ray Train (DDP at dp=4) on the slowdown")
    ap.add_argument("--plot", help="write the run report (loss, throughput, per-rank pace) of the first act run here")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config override for every run (balance.mode is the benchmark's), e.g. "
                         "balance.payback_steps=5000; repeatable")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "straggler.json"))
    args = ap.parse_args()
    layout = tuple(int(v) for v in args.layout.lower().split("x"))
    import ray

    cluster, _ = start_cluster(4)
    runs = []
    try:
        for rnd in range(args.rounds):
            runs.append(run_once(args.steps, args.factor, "off", False, f"base{rnd}", args.micro_batch, layout,
                                 overrides=args.set))
            for mode in MODES:
                runs.append(run_once(args.steps, args.factor, mode, True, f"{mode}{rnd}", args.micro_batch, layout,
                                     args.plot if mode == "act" and rnd == 0 else None, overrides=args.set))
            if not args.no_ray_train:
                runs += [ray_train_once(args.steps, args.factor, slow, args.micro_batch) for slow in (False, True)]
            print(json.dumps(runs[-len(MODES) - 3:], indent=None), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()

    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    base = [r for r in runs if not r["slow"] and r["mode"] == "off"]
    keys = ("tokens_per_s", "slow_third_tokens_per_s")
    table = {"baseline": {k: med(base, k) for k in keys}}
    for mode in MODES:
        rows = [r for r in runs if r["slow"] and r["mode"] == mode]
        table[mode] = {k: med(rows, k) for k in keys}
        table[mode]["spread_slow_third"] = [round(r["slow_third_tokens_per_s"]) for r in rows]
    lost = table["baseline"]["slow_third_tokens_per_s"] - table["off"]["slow_third_tokens_per_s"]
    for mode in MODES:
        got = table[mode]["slow_third_tokens_per_s"] - table["off"]["slow_third_tokens_per_s"]
        table[mode]["recovered_share"] = got / lost if lost > 0 else None
        table[mode]["lost_share"] = 1 - table[mode]["slow_third_tokens_per_s"] / table["baseline"]["slow_third_tokens_per_s"]
    rt = {slow: [r for r in runs if r["mode"] == "ray_train" and r["slow"] == slow] for slow in (False, True)}
    if rt[False] and rt[True]:
        table["ray_train_baseline"] = {k: med(rt[False], k) for k in keys}
        table["ray_train"] = {k: med(rt[True], k) for k in keys}
        table["ray_train"]["spread_slow_third"] = [round(r["slow_third_tokens_per_s"]) for r in rt[True]]
        table["ray_train"]["lost_share"] = 1 - (table["ray_train"]["slow_third_tokens_per_s"]
                                                / table["ray_train_baseline"]["slow_third_tokens_per_s"])
    print(f"layout dp x pp = {args.layout}, micro-batch {args.micro_batch}, {args.steps} steps, {args.rounds} round(s)")
    print("| run | tokens/s (whole run) | tokens/s (slow third) | spread (slow third) | lost (slow third) | recovered |")
    print("|---|---|---|---|---|---|")
    print(f"| no straggler | {table['baseline']['tokens_per_s']:,.0f} | "
          f"{table['baseline']['slow_third_tokens_per_s']:,.0f} | | | |")
    for mode in MODES:
        t = table[mode]
        share = "" if t["recovered_share"] is None else f"{t['recovered_share']:.0%}"
        print(f"| {args.factor:g}x straggler, balance.mode={mode} | {t['tokens_per_s']:,.0f} | "
              f"{t['slow_third_tokens_per_s']:,.0f} | {t['spread_slow_third']} | {t['lost_share']:.0%} | {share} |")
    if "ray_train" in table:
        b, t = table["ray_train_baseline"], table["ray_train"]
        print(f"| Ray Train (DDP, dp=4), no straggler | {b['tokens_per_s']:,.0f} | {b['slow_third_tokens_per_s']:,.0f} "
              "| | | |")
        print(f"| Ray Train (DDP, dp=4), {args.factor:g}x straggler | {t['tokens_per_s']:,.0f} | "
              f"{t['slow_third_tokens_per_s']:,.0f} | {t['spread_slow_third']} | {t['lost_share']:.0%} | 0% (waits) |")
    table["decisions"] = decision_table(runs)
    print_decisions(table["decisions"], args.factor)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "table": table, "runs": runs}, indent=1))


# (decision, figure) pairs summarised per mode: the medians over rounds, and every round's value.
DECISION_FIGURES = (("named", "steps_after_start"), ("named", "slow_pace"), ("recovered", "steps_after_end"),
                    ("spare", "payback_steps"), ("spare", "predicted_step_s"), ("spare", "step_s_before"),
                    ("readmit", "probe_speedup"), ("readmit", "benched_steps"))


def decision_table(runs: list[dict]) -> dict:
    """Per mode: how many rounds took each decision, and the median (and every value) of its figures."""
    table = {}
    for mode in ("detect", "act"):
        rows = [r.get("decisions") or {} for r in runs if r["slow"] and r["mode"] == mode]
        if not rows:
            continue
        t = {"rounds": len(rows)}
        for what in ("named", "recovered", "shares", "spare", "readmit"):
            t[f"{what}_rounds"] = sum(1 for d in rows if what in d)
        for what, key in DECISION_FIGURES:
            values = [d[what][key] for d in rows if what in d and d[what].get(key) is not None]
            if values:
                t[f"{what}.{key}"] = {"median": statistics.median(values), "values": values}
        table[mode] = t
    return table


def print_decisions(table: dict, factor: float) -> None:
    print(f"\nDecisions on the {factor:g}x straggler (median over the rounds that took each; all rounds in brackets):")
    print("| mode | named (rounds) | steps to naming | slow_pace at naming | recovered, steps after the end "
          "| spare (rounds) | spare payback (steps) | spare predicted / measured step (s) "
          "| let back in (rounds) | probe speedup at readmit |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def fig(t, key, fmt="{:.2f}"):
        v = t.get(key)
        return "" if v is None else f"{fmt.format(v['median'])} {[round(x, 2) for x in v['values']]}"

    for mode, t in table.items():
        pred, meas = t.get("spare.predicted_step_s"), t.get("spare.step_s_before")
        step = f"{pred['median']:.4f} / {meas['median']:.4f}" if pred and meas else ""
        print(f"| {mode} | {t['named_rounds']}/{t['rounds']} | {fig(t, 'named.steps_after_start', '{:.0f}')} "
              f"| {fig(t, 'named.slow_pace')} | {fig(t, 'recovered.steps_after_end', '{:.0f}')} "
              f"| {t['spare_rounds']}/{t['rounds']} | {fig(t, 'spare.payback_steps', '{:.1f}')} | {step} "
              f"| {t['readmit_rounds']}/{t['rounds']} | {fig(t, 'readmit.probe_speedup')} |")


if __name__ == "__main__":
    main()
