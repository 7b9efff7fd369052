"""Part of ``benchmarks/lab.py``: every communication mode at capped links, beside Ray Train DDP, with the
cost model's prediction of each.

For each cap (``tbf`` on every host's link, each way) a lab of 4 worker hosts
runs, at dp=4 x pp=1 on the demo GPT (``comm.demo_config``):

1. a calibration: an all-reduce sweep across the 4 hosts over their capped
   links (``_lab_sweep``), fitted to alpha/beta per algorithm
   (``calibration.fit_constants``); the parameter server's latency stays the
   built-in one (Ray's object store), its bandwidth the ring's;
2. each mode (none, fp16, int8, topk, PowerSGD; local SGD, DiLoCo, the
   parameter server; local SGD and DiLoCo with their meetings in fp16):
   median step after warm-up (``comm.steady_stats``);
3. Ray Train's TorchTrainer with DDP, the same model and data
   (``_lab_ray_train``);
4. the planner's prediction of each mode with the sweep's constants and a
   compute rate measured once, on the first cap, from local SGD's steps
   that do not communicate (so the second cap's predictions are out of
   sample), and the mode the planner would choose there.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from comm import add_predictions, demo_config, steady_stats

from lab import Lab, LabRun

HERE = Path(__file__).resolve().parent
MODES = ([(c, "allreduce") for c in ("none", "fp16", "int8", "topk", "powersgd")]
         + [("none", s) for s in ("local_sgd", "diloco", "parameter_server")]
         + [("fp16", s) for s in ("local_sgd", "diloco")])   # meetings sent in fp16
SWEEP_PORT = 29611


def calibrate(lab: Lab, max_bytes: int, out: Path) -> dict:
    """The constants document of an all-reduce sweep across the lab's 4 worker hosts."""
    from elastic_trainer.planning import calibration
    from elastic_trainer.planning.constants import DEFAULT_CONSTANTS

    hosts = lab.hosts[1:5]
    rows_path = out / "sweep.json"
    procs = [lab.spawn(h, [sys.executable, str(HERE / "_lab_sweep.py"), str(r), str(len(hosts)), hosts[0].address,
                           str(SWEEP_PORT), str(max_bytes), str(rows_path)],
                       env={"PYTHONPATH": str(HERE.parent)}, log="sweep")
             for r, h in enumerate(hosts)]
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise RuntimeError(f"the lab sweep failed; see {hosts[0].dir / 'sweep.log'}")
    rows = json.loads(rows_path.read_text())
    fits = calibration.fit_constants(rows)
    doc = calibration.constants_document(rows, fits, None, procs=len(hosts), backend="gloo",
                                         command="python benchmarks/lab.py --part comm")
    ps = dict(DEFAULT_CONSTANTS["algorithms"]["ps"])
    ps["beta_s_per_byte"] = fits["ring"]["beta_s_per_byte"]
    ps["derived_from"] = "Ray's object-store latency (built in), the lab ring's bandwidth"
    doc["algorithms"]["ps"] = ps
    return doc


def mode_run(lab: Lab, compression: str, sync: str, steps: int, warmup: int, out: Path) -> dict:
    cfg = demo_config(steps, f"lab-comm-{compression}-{sync}", compression, sync)
    cfg["failure"] = {"startup_timeout_s": 60}
    result = LabRun(lab, cfg, out).result(timeout_s=600)
    rec = {"compression": compression, "sync": sync}
    if "error" in result:
        rec["error"] = result["error"]
        return rec
    local = cfg["comm"].get("local_steps", 8) if sync in ("local_sgd", "diloco") else None
    rec.update(steady_stats(result["history"], warmup, local))
    if sync == "local_sgd":
        # Steps that sent nothing: compute and the step's own cost alone.
        quiet = [r["step_time_s"] for r in result["history"][warmup:] if not r.get("comm_bytes")]
        rec["no_comm_step_s"] = statistics.median(quiet) if quiet else None
    return rec


def ray_train_run(lab: Lab, steps: int, warmup: int, out: Path) -> dict:
    cfg = demo_config(steps, "lab-ray-train", "none", "allreduce")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    times_path = out / "ray_train.json"
    p = lab.spawn(lab.head, [sys.executable, str(HERE / "_lab_ray_train.py"), str(out / "config.json"),
                             str(times_path)],
                  env={"RAY_ADDRESS": lab.gcs_address, "PYTHONPATH": str(HERE.parent)}, log="ray_train")
    if p.wait(timeout=900) != 0 or not times_path.exists():
        log = lab.head.dir / "ray_train.log"   # gone with the lab: its end goes into the error
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        return {"compression": "ray_train_ddp", "sync": "allreduce", "error": f"Ray Train failed: {tail}"}
    times = json.loads(times_path.read_text())[warmup:]
    return {"compression": "ray_train_ddp", "sync": "allreduce", "steps": len(times),
            "median_step_s": statistics.median(times)}


def compute_from(no_comm_step_s: float, cfg_raw: dict) -> dict:
    """The planner's compute dict that prices a step without communication at what was measured."""
    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.models.factory import block_param_counts

    cfg = TrainerConfig.model_validate(cfg_raw)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len // cfg.parallel.dp
    return {"seconds": no_comm_step_s, "params": sum(block_param_counts(cfg.model)), "tokens": tokens,
            "optimizer_s_per_param": 0.0, "step_overhead_s": 0.0}


def planner_choice(steps: int, constants: dict, compute: dict | None) -> dict:
    """What the planner would choose for 4 workers on this link: its fastest row at dp=4 x pp=1."""
    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.planning.planner import predict_candidates

    cfg = TrainerConfig.model_validate(demo_config(steps, "predict", "none", "allreduce"))
    rows = [r for r in predict_candidates(cfg, 4, constants, compute) if (r["dp"], r["pp"]) == (4, 1)]
    return {k: rows[0][k] for k in ("compression", "sync", "total_s")} if rows else {}


def one_cap(cap: float, cpus: float, steps: int, warmup: int, max_bytes: int, tmp: Path,
            compute: dict | None, modes=MODES) -> tuple[dict, dict | None]:
    """Everything measured at one link cap; the compute dict to price the next cap with."""
    t0 = time.time()
    with Lab(hosts=5, cpus_per_host=cpus, head_cpus=0.5, link_mbit=cap) as lab:
        lab.start_ray()
        constants = calibrate(lab, max_bytes, tmp)
        ring = constants["algorithms"]["ring"]
        print(f"{cap:g} Mbit/s: ring alpha {ring['alpha_s'] * 1e3:.2f} ms, "
              f"{1 / ring['beta_s_per_byte'] / 1e6:.1f} MB/s", flush=True)
        runs = []
        for compression, sync in modes:
            lab.revive()
            rec = mode_run(lab, compression, sync, steps, warmup, tmp / f"{cap:g}-{compression}-{sync}")
            print(json.dumps(rec), flush=True)
            runs.append(rec)
        lab.revive()
        ddp = ray_train_run(lab, steps, warmup, tmp / f"{cap:g}-ray-train")
        print(json.dumps(ddp), flush=True)
    if compute is None:
        quiet = next((r.get("no_comm_step_s") for r in runs if r["sync"] == "local_sgd"), None)
        compute = compute_from(quiet, demo_config(steps, "c", "none", "allreduce")) if quiet else None
    add_predictions([r for r in runs if "error" not in r], steps, constants, compute)
    if compute:
        constants["compute"] = compute   # `elastic-trainer plan --constants` on this link prices with both
    choice = planner_choice(steps, constants, compute)
    measured = [r for r in runs if r.get("median_step_s")]
    best = min(measured, key=lambda r: r.get("window_mean_step_s") or r["median_step_s"]) if measured else None
    return {"cap_mbit": cap, "cpus_per_host": cpus, "constants": constants, "compute": compute, "runs": runs,
            "ray_train": ddp, "best_measured": best and (best["compression"], best["sync"]),
            "planner_choice": choice,
            "seconds": round(time.time() - t0)}, compute


def report(caps: list[dict]) -> None:
    for c in caps:
        none = next((r for r in c["runs"] if (r["compression"], r["sync"]) == ("none", "allreduce")), {})
        base = none.get("median_step_s")
        ddp = c["ray_train"].get("median_step_s")
        print(f"\n{c['cap_mbit']:g} Mbit/s (ring {1 / c['constants']['algorithms']['ring']['beta_s_per_byte'] / 1e6:.1f}"
              f" MB/s measured); Ray Train DDP {ddp * 1e3:.0f} ms" if ddp else f"\n{c['cap_mbit']:g} Mbit/s")
        pick = c.get("planner_choice") or {}
        print(f"planner's choice on this link: {pick.get('compression')}/{pick.get('sync')}, best measured: "
              f"{'/'.join(c['best_measured'] or ())}")
        print("mode                       step ms   x none   x DDP   predicted ms   error")
        for r in c["runs"]:
            if "error" in r:
                print(f"{r['compression'] + '/' + r['sync']:26s} failed: {r['error'][:80]}")
                continue
            step = r.get("window_mean_step_s") or r["median_step_s"]
            pred = r.get("predicted", {}).get("total_s")
            print(f"{r['compression'] + '/' + r['sync']:26s} {step * 1e3:7.0f}   "
                  f"{step / base if base else float('nan'):6.2f}   {step / ddp if ddp else float('nan'):5.2f}   "
                  + (f"{pred * 1e3:12.0f}   {r['rel_error']:5.1%}" if pred else "           -       -"))
