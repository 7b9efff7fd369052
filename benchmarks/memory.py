"""Memory of a model larger than one process: an HF Llama at dp=1 x pp=4 on four simulated nodes.

Two runs of ``--steps`` steps each (3 by default), with a durable checkpoint at the
last step and the final weights written:

  config   the Llama built from its config, each rank its own blocks from the seed
  folder   the same Llama loaded from a sharded Hugging Face folder (``model.init_from``),
           written beforehand by ``save_pretrained(max_shard_size=...)`` in a child process

Per rank (from the controller's status and the step records; VmHWM read by each worker):
the set-up peak above idle (idle: the worker's resident set before it builds), the
steady peak (the largest per-step peak after step 1, when AdamW's state exists), and
the plan's estimate for that rank (``planning.policy.rank_estimates``: what
``elastic-trainer plan`` prints). The controller's and the driver's peaks above idle
over the whole run, the save and the durable checkpoint included: the controller
process is found by its title and sampled every 0.1 s; the driver resets its own
high-water mark before ``fit()``. The durable checkpoint's write (the run's event:
parts written by their workers, the manifest last) is set against the old
one-process write of the same parts: every part fetched into one process, then
``DurableStore.save``.

Targets (PASS/MISS printed, nothing asserted):
  set-up peak above idle <= 1.5 x the rank's own parameter bytes + 150 MB
  controller and driver peaks above idle < 25% of the model's bytes (fp32)
  steady peak per rank within 15% of the plan's estimate

    python benchmarks/memory.py                     # 16 x 1024 Llama (271 M parameters)
    python benchmarks/memory.py --layers 4 --hidden 256 --vocab 4096 --skip-folder   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NODES = 4   # one-CPU nodes with 2 GiB object stores: scale.py's start_cluster
DATA_PATH = "~/.cache/elastic_trainer/stdlib-corpus-128"
MB = 1e6


def hf_config(args) -> dict:
    return {"model_type": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
            "intermediate_size": args.hidden * 11 // 4, "num_hidden_layers": args.layers,
            "num_attention_heads": args.hidden // 64, "num_key_value_heads": args.hidden // 64,
            "max_position_embeddings": 256, "tie_word_embeddings": False}


def job(args, name: str, work: Path, init_from: str | None) -> dict:
    model = {"kind": "hf", "hf_config": hf_config(args)}
    if init_from:
        model["init_from"] = init_from
    return {
        "run": {"name": name, "log_every": 10_000, "report_dir": None, "output_dir": str(work / f"out-{name}")},
        "model": model,
        "data": {"path": os.path.abspath(os.path.expanduser(DATA_PATH)), "seq_len": 128, "prepare": "stdlib"},
        "train": {"steps": args.steps, "global_batch_size": 4, "micro_batch_size": 1, "lr": 1e-4},
        "parallel": {"dp": 1, "pp": 4},
        # One snapshot kept (default 2): at 2, the object stores hold 2 kept x 2 replicas x 12 bytes a
        # parameter (13 GB at 271 M), more than this 24 GB machine has beside the workers.
        "checkpoint": {"storage": str(work / f"ck-{name}"), "durable_every": args.steps,
                       "snapshots_kept": args.snapshots_kept},
    }


def write_folder(args, path: Path) -> None:
    """The model's weights as a sharded HF folder, written by a child process (its memory is its own)."""
    code = (
        "import json, sys, torch, transformers\n"
        "cfg = transformers.AutoConfig.for_model(**json.loads(sys.argv[1]))\n"
        "torch.manual_seed(0)\n"
        "m = transformers.AutoModelForCausalLM.from_config(cfg)\n"
        "m.save_pretrained(sys.argv[2], max_shard_size=sys.argv[3])\n")
    subprocess.run([sys.executable, "-c", code, json.dumps(hf_config(args)), str(path), args.max_shard_size],
                   check=True)


def _proc_kb(pid: int | str, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


class ControllerWatch:
    """Samples the controller actor's process: its resident set when first seen (idle) and VmHWM."""

    def __init__(self):
        self.pid, self.idle, self.peak = None, None, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _find(self) -> int | None:
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if (d / "cmdline").read_bytes().startswith(b"ray::ControllerActor"):
                        return int(d.name)
                except OSError:
                    pass
        return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.pid is None:
                self.pid = self._find()
                if self.pid is not None:
                    self.idle = _proc_kb(self.pid, "VmRSS")
            if self.pid is not None:
                self.peak = max(self.peak, _proc_kb(self.pid, "VmHWM") or 0)
            time.sleep(0.1)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"pid": self.pid, "idle_bytes": self.idle, "peak_bytes": self.peak,
                "above_idle_bytes": self.peak - (self.idle or 0)}


def one_run(raw: dict) -> dict:
    import ray

    from elastic_trainer import Trainer, TrainerConfig
    from elastic_trainer.naming import NAMESPACE, controller_name
    from elastic_trainer.planning.plan import make_plan
    from elastic_trainer.planning.policy import rank_estimates
    from elastic_trainer.worker.memory_use import peak_rss_bytes, reset_peaks, rss_bytes

    import torch

    cfg = TrainerConfig.model_validate(raw)
    plan = make_plan(cfg)
    estimates = rank_estimates(cfg, 1, 4, plan.stage_bounds)
    setup: dict = {}
    steady: dict[int, int] = {}

    def on_step(rec: dict) -> None:
        try:
            st = ray.get(ray.get_actor(controller_name(raw["run"]["name"]), namespace=NAMESPACE).status.remote())
        except (ValueError, ray.exceptions.RayError):   # the run has ended: its records come after
            return
        if not setup:
            setup.update(st["memory"]["setup"])
        if rec["step"] > 1:   # from step 2, AdamW's state exists: the steady peak
            for r, b in (st["memory"]["step_peak_rss_bytes"] or {}).items():
                steady[int(r)] = max(steady.get(int(r), 0), b)

    watch = ControllerWatch()
    driver_idle = rss_bytes()
    reset_peaks(torch.device("cpu"))
    t0 = time.perf_counter()
    result = Trainer(cfg, verbose=False, on_step=on_step).fit()
    wall = time.perf_counter() - t0
    driver_peak = peak_rss_bytes()
    controller = watch.stop()
    durable = [e for e in result.events if e.get("kind") == "durable_checkpoint"][-1]
    ranks = []
    for est in estimates:
        r = est["rank"]
        mem = setup.get(r) or setup.get(str(r)) or {}
        own = est["weights"]   # fp32: 4 bytes a parameter
        above = mem["setup_peak_rss_bytes"] - mem["idle_rss_bytes"]
        ranks.append({"rank": r, "params": own // 4, "idle_bytes": mem["idle_rss_bytes"],
                      "setup_peak_above_idle_bytes": above, "setup_bound_bytes": 1.5 * own + 150e6,
                      "steady_peak_bytes": steady.get(r), "estimate_bytes": est["bounded"],
                      "estimate": est})
    return {"wall_s": wall, "steps": len(result.history), "ranks": ranks, "controller": controller,
            "driver": {"idle_bytes": driver_idle, "peak_bytes": driver_peak,
                       "above_idle_bytes": driver_peak - driver_idle},
            "durable": {k: durable.get(k) for k in ("step", "path", "seconds", "bytes", "parts")},
            "model_path": result.model_path}


def one_process_write(durable: dict, work: Path) -> dict:
    """The old path at the same size: every part fetched into one process, then written by it."""
    import ray

    from elastic_trainer.checkpoint.durable import DurableStore

    src = Path(durable["path"])
    store = DurableStore(str(src.parent), None, 3)
    parts, manifest = store.load_dir(src.name)
    refs = [ray.put(p) for p in parts]
    del parts
    out = DurableStore(str(work / "one-process"), None, 3)
    t0 = time.perf_counter()
    fetched = ray.get(refs)
    t1 = time.perf_counter()
    out.save(manifest["step"], fetched, {k: v for k, v in manifest.items() if k not in ("files", "step", "format", "run_id", "created")})
    t2 = time.perf_counter()
    return {"fetch_s": t1 - t0, "write_s": t2 - t1, "seconds": t2 - t0, "bytes": sum(e["bytes"] for e in manifest["files"])}


def verdicts(row: dict, model_bytes: int) -> list[str]:
    out = []
    for r in row["ranks"]:
        ok = r["setup_peak_above_idle_bytes"] <= r["setup_bound_bytes"]
        out.append(f"rank {r['rank']} set-up peak above idle {r['setup_peak_above_idle_bytes'] / MB:.0f} MB "
                   f"<= {r['setup_bound_bytes'] / MB:.0f} MB: {'PASS' if ok else 'MISS'}")
        if r["steady_peak_bytes"]:
            off = r["steady_peak_bytes"] / r["estimate_bytes"] - 1
            out.append(f"rank {r['rank']} steady peak {r['steady_peak_bytes'] / MB:.0f} MB vs estimate "
                       f"{r['estimate_bytes'] / MB:.0f} MB ({off:+.1%}): {'PASS' if abs(off) <= 0.15 else 'MISS'}")
    for who in ("controller", "driver"):
        above = row[who]["above_idle_bytes"]
        out.append(f"{who} peak above idle {above / MB:.0f} MB < 25% of the model ({0.25 * model_bytes / MB:.0f} MB): "
                   f"{'PASS' if above < 0.25 * model_bytes else 'MISS'}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-shard-size", default="200MB")
    ap.add_argument("--snapshots-kept", type=int, default=1)
    ap.add_argument("--skip-folder", action="store_true", help="only the run built from the config")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory.json"))
    args = ap.parse_args()

    import ray

    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.models.factory import block_param_counts
    from scale import start_cluster

    work = Path(tempfile.mkdtemp(prefix="et-memory-"))
    rows: dict = {}
    runs = [("config", None)] + ([] if args.skip_folder else [("folder", str(work / "hf-in"))])
    if not args.skip_folder:
        write_folder(args, work / "hf-in")
    cfg = TrainerConfig.model_validate(job(args, "mem-config", work, None))
    n_params = sum(block_param_counts(cfg.model))
    model_bytes = 4 * n_params
    print(f"Llama {args.layers} x {args.hidden}, vocab {args.vocab}: {n_params / 1e6:.0f} M parameters, "
          f"{model_bytes / 1e9:.2f} GB in fp32; dp=1 x pp=4 on {NODES} simulated nodes; work dir {work}")
    for label, init_from in runs:
        raw = job(args, f"mem-{label}", work, init_from)
        cluster, _ = start_cluster()
        try:
            row = one_run(raw)
            row["one_process_write"] = one_process_write(row["durable"], work)
        finally:
            ray.shutdown()
            cluster.shutdown()
        rows[label] = row
        print(f"\n{label}: {row['steps']} steps in {row['wall_s']:.0f} s")
        for r in row["ranks"]:
            print(f"  rank {r['rank']}: {r['params'] / 1e6:.1f} M params, idle {r['idle_bytes'] / MB:.0f} MB, set-up "
                  f"peak +{r['setup_peak_above_idle_bytes'] / MB:.0f} MB, steady peak "
                  f"{(r['steady_peak_bytes'] or 0) / MB:.0f} MB, estimate {r['estimate_bytes'] / MB:.0f} MB")
        d, one = row["durable"], row["one_process_write"]
        print(f"  durable checkpoint: {d['bytes'] / MB:.0f} MB in {d['seconds']:.2f} s by {len(d['parts'])} writers; "
              f"one process: {one['seconds']:.2f} s (fetch {one['fetch_s']:.2f} s + write {one['write_s']:.2f} s)")
        for line in verdicts(row, model_bytes):
            print("  " + line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "params": n_params, "model_bytes": model_bytes, "runs": rows},
                              indent=2, default=str))
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    main()
