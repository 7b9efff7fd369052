"""The CUDA and NCCL paths, checked on the GPUs this machine has, in one table.

    bash scripts/gpu_check.sh                # everything, at most 10 minutes
    bash scripts/gpu_check.sh --parts comm,snapshot
    python benchmarks/gpu_check.py --self-test   # no GPU: the same plumbing on CPU (gloo), no snapshot part

Parts (see each module's docstring):
1. ``comm`` (_gpu_comm): every codec and algorithm on CUDA tensors across 4
   processes against the CPU result.
2. ``ranks`` and ``ray`` (_gpu_train): a bf16 step at dp x pp with the ranks on
   the GPU(s), against CPU; the product end to end on a local Ray head.
3. ``snapshot`` (_gpu_snapshot): the snapshot's device-to-host GB/s against a
   plain pinned copy (target: 80% or better).
4. ``kill`` (_gpu_train, 2+ GPUs): a rank SIGKILLed mid-step; the survivor
   aborts (or shrinks) and rejoins in its own process (target: under 2 s).

Prints one table and writes benchmarks/results/gpu-check.json. Exits non-zero
when a part fails; a part skipped (too few GPUs, over the time budget) says why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PARTS = ("comm", "ranks", "ray", "snapshot", "kill")
# Seconds each part may need at most; a part is skipped when less than this is left.
NEEDS = {"comm": 90, "ranks": 120, "ray": 120, "snapshot": 60, "kill": 150}


def _environment() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count()}
    if info["gpus"]:
        info["gpu"] = torch.cuda.get_device_name(0)
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a build without NCCL
            info["nccl"] = None
    import torch.distributed as dist
    info["shrink_group"] = hasattr(dist, "shrink_group")
    return info


def _s(seconds) -> str:
    return "?" if seconds is None else f"{seconds:.2f} s"


def _rows(results: dict, device: str) -> list[tuple[str, str, str]]:
    """(check, figure, verdict) rows of the table."""
    rows = []
    comm = results.get("comm")
    if comm and "rows" in comm:
        for name, r in comm["rows"].items():
            fig = (r["error"] or f"rel err {r['rel_err']:.1e} (tol {r['tolerance']:.0e}), comm {r['comm_s'] * 1e3:.1f} ms")
            rows.append((f"{r['kind']} {name} on {comm['device']} x{comm['procs']} [{comm['backend']}]", fig,
                         "ok" if r["ok"] else "FAIL"))
    ranks = results.get("ranks")
    if ranks and "gpu" in ranks:
        g = ranks["gpu"]
        rows.append((f"bf16 dp2 x pp2 ranks [{g['backend']}] vs CPU",
                     f"loss diff {ranks['max_rel_loss_diff']:.1e}, step {g['step_s'] * 1e3:.0f} ms, comm "
                     f"{g['comm_s'] * 1e3:.1f} ms, exposed {g['exposed_comm_s'] * 1e3:.1f} ms",
                     "ok" if ranks["ok"] else "FAIL"))
    ray_part = results.get("ray")
    if ray_part and "layout" in ray_part:
        rows.append((f"bf16 {ray_part['layout']} through Ray workers ({'NCCL' if device == 'cuda' else 'gloo'})",
                     f"{ray_part['state']}, step {ray_part['step_s'] * 1e3:.0f} ms, last loss {ray_part['losses'][-1]:.3f}",
                     "ok" if ray_part["ok"] else "FAIL"))
    snap = results.get("snapshot")
    if snap and "ratio" in snap:
        rows.append((f"snapshot D2H, {snap['bytes'] / 1e9:.1f} GB in {snap['tensors']} tensors",
                     f"{snap['snapshot_gbs']:.1f} GB/s vs pinned copy {snap['pinned_gbs']:.1f} GB/s "
                     f"({snap['ratio']:.0%}; target 80%)", "ok" if snap["ok"] else "FAIL"))
    kill = results.get("kill")
    if kill and "state" in kill:
        rows.append((f"kill rank 1 of dp2 ({'2 GPUs' if device == 'cuda' else 'CPU workers'})",
                     f"recovered in {_s(kill['recovery_s'])} (detect {_s(kill['detect_s'])}, re-plan "
                     f"{_s(kill['replan_s'])}, restore {_s(kill['restore_s'])}), groups {kill['groups']}, "
                     "survivor kept its process: "
                     f"{kill['survivor_kept_process']}; target < 2 s", "ok" if kill["ok"] else "FAIL"))
    for part, r in results.items():
        if isinstance(r, dict) and ("skipped" in r or "error" in r):
            rows.append((part, r.get("skipped") or r.get("error"), "skipped" if "skipped" in r else "FAIL"))
    return rows


def _table(rows) -> str:
    widths = [max(len(r[i]) for r in rows + [("check", "figure", "result")]) for i in range(3)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(("check", "figure", "result"), widths)) + " |"
    out = [line, "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--budget-s", type=float, default=570.0, help="skip parts that would not fit in this")
    ap.add_argument("--self-test", action="store_true", help="no GPU needed: run the orchestration on CPU")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu-check.json"))
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {unknown}; valid: {', '.join(PARTS)}")
    env = _environment()
    print(json.dumps(env))
    device = "cuda" if env["gpus"] else "cpu"
    if device == "cpu" and not args.self_test:
        print("no CUDA device here: nothing to check (use --self-test to run the checks' plumbing on CPU)")
        return 2
    start = time.monotonic()
    results: dict = {}
    for part in parts:
        left = args.budget_s - (time.monotonic() - start)
        if left < NEEDS[part]:
            results[part] = {"skipped": f"{left:.0f} s left of the budget, the part needs up to {NEEDS[part]} s"}
            continue
        if device == "cpu" and part == "snapshot":
            results[part] = {"skipped": "needs CUDA"}
            continue
        t0 = time.monotonic()
        try:
            if part == "comm":
                import _gpu_comm
                with tempfile.TemporaryDirectory() as d:
                    results[part] = _gpu_comm.run(str(Path(d) / "comm.json"), device)
            elif part == "snapshot":
                import _gpu_snapshot
                results[part] = _gpu_snapshot.run()
            else:
                import _gpu_train
                results.update(_gpu_train.run({part}, gpu=device == "cuda"))
        except Exception as e:  # noqa: BLE001 - one part's failure is a row, the others still run
            traceback.print_exc()
            results[part] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
        results[part]["seconds"] = time.monotonic() - t0
        print(f"{part}: {results[part]['seconds']:.0f} s", flush=True)
    rows = _rows(results, device)
    print()
    print(_table(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"environment": env, "results": results, "self_test": args.self_test},
                                         indent=1, default=str))
    return 1 if any(r[2] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
