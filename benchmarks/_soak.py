"""The soak of ``benchmarks/recovery.py --soak``: the demo GPT for 300 steps on 6 simulated nodes,
failure-free and then with 5 node losses at seeded random moments (``elastic_trainer.chaos.soak``)
while 2 nodes are added. Reports the wall-time overhead, each recovery's seconds by phase,
the object-store bytes over time, and whether every sample was seen once at the same loss."""

from __future__ import annotations

import statistics
import tempfile
import time

NODES = 6


def _run(raw: dict, on_step=None) -> tuple[object, float, list]:
    from elastic_trainer import Trainer, TrainerConfig
    from elastic_trainer.chaos.simulate import object_store_bytes

    samples = []
    t0 = time.perf_counter()

    def step(rec):
        if rec["step"] % 5 == 0:
            try:
                used = object_store_bytes()
            except Exception:  # noqa: BLE001 - the memory query asks every raylet; a dead one refuses a while
                used = None
            if used is not None:
                samples.append({"t": round(time.perf_counter() - t0, 2), "step": rec["step"], "bytes": used})
        if on_step:
            on_step(rec)

    result = Trainer(TrainerConfig.model_validate(raw), verbose=False, on_step=step).fit()
    return result, time.perf_counter() - t0, samples


def run_soak(demo_config, start_cluster, seed: int, steps: int = 300) -> dict:
    """Both runs on fresh 6-node clusters (``start_cluster(n)``); the result as a JSON-able dict."""
    import ray

    from elastic_trainer.chaos.soak import Soak, SoakPlan
    from elastic_trainer.worker.faults import SETUP_DELAY_ENV

    storage = tempfile.mkdtemp(prefix="et-soak-")

    def cfg(name):
        # micro-batches of 2: 1F1B over 3 stages needs at least 3 per replica.
        return demo_config(steps, name, parallel={"dp": 2, "pp": 3}, train={"micro_batch_size": 2},
                           scaling={"env_vars": {SETUP_DELAY_ENV: "2"}, "grow_check_s": 1.0},
                           failure={"max_failures": 12, "allow_fault_injection": True},
                           checkpoint={"storage": f"{storage}/{name}", "durable_every": 20, "keep_durable": 2})

    out: dict = {"seed": seed, "steps": steps, "nodes": NODES}
    for name in ("clean", "soak"):
        c, nodes = start_cluster(NODES)
        try:
            if name == "clean":
                print(f"soak: failure-free run, {steps} steps on {NODES} nodes ...", flush=True)
                result, wall, samples = _run(cfg("clean"))
            else:
                plan = SoakPlan.draw(seed, steps, 20)
                print(f"soak: seed {seed}: {plan}", flush=True)
                soak = Soak(c, list(nodes), "soak", plan)
                soak.start()
                result, wall, samples = _run(cfg("soak"), soak.on_step)
                out["actions"] = [{k: v for k, v in e.items() if k != "time"} for e in soak.log]
        finally:
            ray.shutdown()
            c.shutdown()
        out[name] = {"wall_s": wall, "object_store": samples,
                     "losses": [r["loss"] for r in result.history],
                     "cursors": [r["cursor"] for r in result.history],
                     "step_s": statistics.median(r["step_time_s"] for r in result.history)}
        if name == "soak":
            out[name]["recoveries"] = [
                {k: r.get(k) for k in ("reason", "failed_step", "restored_step", "steps_redone", "attempts",
                                       "detect_s", "replan_s", "restore_s", "first_step_s", "total_s",
                                       "failed_attempts_s", "sources", "plan_before", "plan_after")}
                for r in result.recoveries]
            out[name]["failures"] = [f["failure"] for f in result.failures]
    clean, soak = out["clean"], out["soak"]
    gb = demo_config(1, "x")["train"]["global_batch_size"]
    out["exactly_once"] = soak["cursors"] == [s * gb for s in range(steps)]
    out["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(soak["losses"], clean["losses"]))
    out["overhead"] = soak["wall_s"] / clean["wall_s"] - 1
    return out


def print_soak(out: dict) -> None:
    clean, soak = out["clean"], out["soak"]
    print(f"\nsoak, seed {out['seed']}: demo GPT dp=2 x pp=3, {out['steps']} steps on {out['nodes']} nodes, "
          f"{sum(a['action'] == 'loss' for a in out['actions'])} node losses, "
          f"{sum(a['action'] == 'add' for a in out['actions'])} nodes added")
    for a in out["actions"]:
        print(f"  {a['action']:<4} at step {a['step']:>3}" + (f" ({a['what']}, {a['state']})" if a["action"] == "loss" else ""))
    print(f"  wall {soak['wall_s']:.1f} s vs {clean['wall_s']:.1f} s failure-free ({out['overhead'] * 100:+.1f}%); "
          f"every sample once: {out['exactly_once']}; max relative loss difference {out['max_rel_loss_diff']:.1e}")
    print("  recovery  reason    failed restored redone attempts  detect  re-plan restore first  total (s)")
    for r in soak["recoveries"]:
        print(f"            {r['reason']:<9} {r['failed_step']:>6} {r['restored_step']:>8} {r['steps_redone']:>6} "
              f"{r['attempts']:>8}  {r['detect_s']:6.2f}  {r['replan_s']:6.2f}  {r['restore_s']:6.2f} "
              f"{r['first_step_s']:5.2f}  {r['total_s']:5.2f}")
    for name, run in (("failure-free", clean), ("soak", soak)):
        b = [s["bytes"] for s in run["object_store"]]
        half = len(b) // 2
        print(f"  object store, {name}: median {statistics.median(b) / 2**20:.1f} MiB, max {max(b) / 2**20:.1f} MiB; "
              f"first half median {statistics.median(b[:half]) / 2**20:.1f}, second half "
              f"{statistics.median(b[half:]) / 2**20:.1f} MiB")
