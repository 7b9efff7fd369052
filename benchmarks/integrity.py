"""What integrity costs and what it catches, on the demo GPT (jobs/demo.yaml, dp=2 x pp=2) on a
simulated cluster of one-CPU nodes (four ranks and a spare).

``cost`` (default): the demo's 300 steps in fp32, bf16 and fp16 with integrity's defaults
(``check_every: auto``), each reporting:

- anomalies and corruptions found (a false alarm: the demo has none to find);
- the check interval ``auto`` settled on, and the checks' cost: the fingerprints' seconds (the
  slowest rank's, each check step) over all steps' time, against ``check_max_overhead`` (1%);
- the verdict's cost: each step's one small all-reduce and its sums (median ``verdict_s``) over
  the median step time;
- the goodput breakdown's ``integrity`` bucket.

``flip``: the demo with one bit flipped in one replica, once per case, reporting the step it
was flipped, the step it was found at, whether a rank was proven at fault (and how: replay or
checksum), the node quarantined, the steps replayed, the time from detection to proof, and the
run's end (its loss against a clean run's):

- ``update``: a parameter as a check step's update wrote it on rank 1 (compute corruption);
- ``rest``: the optimizer state of rank 2 as the step after a check begins (memory, at rest);
- ``between``: a parameter as a step between checks wrote it (its gradients reach the other
  replica before the check: found, undone by the replay, nobody blamed).

``verdict``: the verdict's own cost, apart from the waits it stands at (in a step its all-reduce is
where ranks that finished early wait for the last, which ``verdict_s`` counts): four gloo
processes on loopback, each summing the squares of the demo's gradients of one stage and
all-reducing the verdict's vector, timed over 200 calls.

    python benchmarks/integrity.py                  # cost: 300 steps x 3 precisions
    python benchmarks/integrity.py --mode verdict   # the verdict alone
    python benchmarks/integrity.py --mode flip      # the three flips, 150 steps each

Writes benchmarks/results/integrity-<mode>.json.
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

from recovery import demo_config, start_cluster  # noqa: E402  (the recovery benchmark's cluster and job)


def _run(raw: dict):
    from elastic_trainer import Trainer, TrainerConfig

    return Trainer(TrainerConfig.model_validate(raw), verbose=False).fit()


def _checks(history: list[dict]) -> list[int]:
    return [r["step"] for r in history if r.get("check_s") is not None]


def cost(steps: int, precisions: list[str]) -> dict:
    out = {}
    for precision in precisions:
        result = _run(demo_config(steps, f"integrity-{precision}", train={"precision": precision}))
        h = result.history
        checked = _checks(h)
        gaps = [b - a for a, b in zip(checked, checked[1:])]
        total = sum(r["step_time_s"] for r in h)
        step_s = statistics.median(r["step_time_s"] for r in h[5:])
        out[precision] = {
            "anomalies": [dict(e) for e in result.anomalies], "corruptions": [dict(e) for e in result.corruptions],
            "checks": len(checked), "interval_median": statistics.median(gaps) if gaps else None,
            "check_s_median": statistics.median(r["check_s"] for r in h if r.get("check_s") is not None)
            if checked else None,
            "check_share": sum(r["check_s"] or 0.0 for r in h if r.get("check_s") is not None) / total,
            "verdict_s_median": statistics.median(r["verdict_s"] for r in h[5:]),
            "step_s_median": step_s,
            "verdict_share": statistics.median(r["verdict_s"] for r in h[5:]) / step_s,
            "goodput_integrity_s": (result.goodput or {}).get("seconds", {}).get("integrity"),
            "final_loss": h[-1]["loss"],
        }
        print(json.dumps({precision: out[precision]}, default=str), flush=True)
    return out


CASES = {
    # (where, rank, how the flip step is placed against the check interval)
    "update": ("parameter", 1, "on"),
    "rest": ("optimizer", 2, "after"),
    "between": ("parameter", 1, "between"),
}


def flip(steps: int, every: int, cases: list[str]) -> dict:
    clean = _run(demo_config(steps, "integrity-clean", integrity={"check_every": every}))
    out = {"check_every": every, "clean_final_loss": clean.history[-1]["loss"]}
    at = steps // 2 // every * every   # a check step near the middle
    for case in cases:
        where, rank, place = CASES[case]
        step = {"on": at, "after": at + 1, "between": at + every // 2 + 1}[place]
        fault = [{"kind": "flip", "where": where, "step": step, "rank": rank, "bit": 12}]
        raw = demo_config(steps, f"integrity-{case}", integrity={"check_every": every},
                          failure={"allow_fault_injection": True},
                          scaling={"env_vars": {"ELASTIC_TRAINER_INTEGRITY_FAULTS": json.dumps(fault)}})
        result = _run(raw)
        evs = [dict(e) for e in result.corruptions]
        recs = [dict(e) for e in result.recoveries]
        replay = next((r for r in recs if r["reason"] == "corruption"), None)
        move = next((r for r in recs if r["reason"] == "quarantine"), None)
        out[case] = {
            "flipped_at": step, "found_at": evs[0]["step"] if evs else None,
            "steps_to_detect": (evs[0]["step"] - step) if evs else None,
            "suspects": evs[0]["suspects"] if evs else None, "proof": evs[0]["proof"] if evs else None,
            "quarantined": (evs[0].get("quarantined") or evs[0].get("quarantined_workers")) if evs else None,
            "detect_to_proof_s": evs[0].get("detect_to_proof_s") if evs else None,
            "steps_replayed": replay["steps_redone"] if replay else None,
            "replay_total_s": replay.get("total_s") if replay else None,
            "move_total_s": move.get("total_s") if move else None,
            "final_loss": result.history[-1]["loss"],
            "same_end_as_clean": result.history[-1]["loss"] == clean.history[-1]["loss"],
            "state": result.state,
        }
        print(json.dumps({case: out[case]}, default=str), flush=True)
    return out


def _verdict_rank(rank: int, world: int, port: int, numel: int, calls: int, out) -> None:
    import time

    import torch
    import torch.distributed as dist

    from elastic_trainer.integrity.verdict import agree, local_sq

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    grads = [torch.randn(n) for n in (numel // 4,) * 4]
    loss = [torch.tensor(2.0)]
    # What clipping ran before at dp=2 x pp=2: a scalar all-reduced over the rank's pipeline.
    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipe, replica = pipes[rank // 2], replicas[rank % 2]
    times = {"sq": [], "all_reduce": [], "world_all_reduce": [], "clip_pipeline_all_reduce": []}
    for i in range(calls + 10):
        dist.barrier()   # every rank arrives together: the call's own time, no wait for a late peer
        t0 = time.perf_counter()
        sq = local_sq(grads, torch.device("cpu"))
        t1 = time.perf_counter()
        agree(loss, 1.0, sq, rank // 2, 2, rank, world, [(replica, 2), (pipe, 2)], torch.device("cpu"))
        t2 = time.perf_counter()
        dist.barrier()
        t3 = time.perf_counter()
        dist.all_reduce(sq.clone(), group=pipe)
        t4 = time.perf_counter()
        dist.barrier()
        t5 = time.perf_counter()
        agree(loss, 1.0, sq, rank // 2, 2, rank, world, None, torch.device("cpu"))   # one level: the world
        t6 = time.perf_counter()
        if i >= 10:
            times["sq"].append(t1 - t0)
            times["all_reduce"].append(t2 - t1)
            times["clip_pipeline_all_reduce"].append(t4 - t3)
            times["world_all_reduce"].append(t6 - t5)
    out[rank] = {k: statistics.median(v) for k, v in times.items()}
    dist.destroy_process_group()


def verdict(calls: int) -> dict:
    import torch.multiprocessing as mp

    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.models.factory import block_param_counts
    from elastic_trainer.worker.process_group import free_port

    cfg = TrainerConfig.model_validate(demo_config(10, "verdict"))
    numel = sum(block_param_counts(cfg.model)) // 2   # one stage of the demo's two
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_verdict_rank, args=(4, free_port("127.0.0.1"), numel, calls, out), nprocs=4, join=True)
    per_rank = dict(out)
    res = {"stage_params": numel, "sq_s_median": statistics.median(r["sq"] for r in per_rank.values()),
           "all_reduce_s_median": statistics.median(r["all_reduce"] for r in per_rank.values()),
           "clip_pipeline_all_reduce_s_median": statistics.median(r["clip_pipeline_all_reduce"]
                                                                  for r in per_rank.values()),
           "world_all_reduce_s_median": statistics.median(r["world_all_reduce"] for r in per_rank.values())}
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("cost", "flip", "verdict"), default="cost")
    ap.add_argument("--steps", type=int, default=None, help="300 (cost), 150 (flip)")
    ap.add_argument("--precisions", default="fp32,bf16,fp16")
    ap.add_argument("--every", type=int, default=4, help="flip: integrity.check_every")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.mode == "verdict":
        res = verdict(200)
        path = Path(args.out or ROOT / "benchmarks" / "results" / "integrity-verdict.json")
        path.write_text(json.dumps(res, indent=1))
        print(f"wrote {path}")
        return
    c, _ = start_cluster(5)
    try:
        if args.mode == "cost":
            res = cost(args.steps or 300, args.precisions.split(","))
        else:
            res = flip(args.steps or 150, args.every, args.cases.split(","))
    finally:
        import ray

        ray.shutdown()
        c.shutdown()
    path = Path(args.out or ROOT / "benchmarks" / "results" / f"integrity-{args.mode}.json")
    path.write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
