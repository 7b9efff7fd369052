"""Parts of ``benchmarks/lab.py``: throughput kept after losing hosts, and false suspicions on a loaded host.

Throughput after a loss: N worker hosts of equal CPU quota, the demo GPT at
dp=N x pp=1 with a global batch every replica count here divides (48
sequences: 12 micro-batches), so a smaller plan is not penalised by an uneven
split. After a window of steady steps, ``lose`` hosts are killed at once; once
the run re-planned, a second window. The yardstick is a fresh run started right
after, in the same lab, on the surviving hosts with the layout the planner
picked for them (what a restart on the survivors would get): kept = tokens/s
after the loss / the fresh run's steady tokens/s. The earlier yardstick, the
throughput before scaled by (N - lose) / N, is reported beside it
(``kept_of_scaled``): it is no ideal (a smaller world communicates less, so it
can be beaten). The planner's choice after the loss is reported with it.

False suspicions: 4 hosts at dp=2 x pp=2, one of them loaded by a CPU burner
in its own cgroup (its worker then gets about half its quota) for the whole
run. Every worker the run suspected (a ``silent`` failure) is counted, and
those of them that answered again (a fence lifted: ``readmitted``) are the
false ones. No host is lost in that run, so every suspicion is false; the
product's answer to one is to fence, not kill.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from recovery import demo_config

from lab import Lab, LabRun

FAILURE = {"startup_timeout_s": 60, "min_step_timeout_s": 5, "rendezvous_timeout_s": 20, "wait_for_nodes_s": 2}


def _tokens_per_s(history: list[dict], plan: int, skip: int) -> tuple[float, int]:
    """Median tokens/s of the steps run on plan index ``plan``, past its first ``skip``."""
    xs = [r["tokens_per_s"] for r in history if r.get("plan") == plan][skip:]
    return (statistics.median(xs) if xs else float("nan")), len(xs)


def throughput_round(lab: Lab, hosts: int, lose: int, window: int, out: Path, skip: int = 5) -> dict:
    """One run on ``hosts`` worker hosts, ``lose`` of them killed after ``window`` steady steps."""
    steps = 2 * (window + skip) + 4
    cfg = demo_config(steps, f"lab-thr-{hosts}-{lose}", parallel={"dp": hosts, "pp": 1},
                      train={"global_batch_size": 48, "micro_batch_size": 4},
                      checkpoint={"memory_every": 5}, failure=FAILURE, balance={"mode": "off"})
    run = LabRun(lab, cfg, out)
    ranks = run.await_step(window + skip)
    victims = [lab.host_at(ranks[r]) for r in range(hosts - lose, hosts)]
    for v in victims:
        lab.kill(v)
    result = run.result()
    if "error" in result:
        raise RuntimeError(f"throughput {hosts}-{lose}: the run failed: {result['error']}")
    plans = result["plans"]
    before, n_before = _tokens_per_s(result["history"], 0, skip)
    last = len(plans) - 1
    after, n_after = _tokens_per_s(result["history"], last, skip)
    scaled = before * (hosts - lose) / hosts
    rec = result["recoveries"][-1]
    layout = {"dp": plans[last]["dp"], "pp": plans[last]["pp"]}
    fresh, n_fresh = _fresh_run(lab, hosts, lose, layout, window, skip, out)
    return {"hosts": hosts, "lost": lose, "tokens_per_s_before": round(before, 1),
            "tokens_per_s_after": round(after, 1), "fresh_on_survivors": round(fresh, 1),
            "kept_of_ideal": round(after / fresh, 3), "scaled_before": round(scaled, 1),
            "kept_of_scaled": round(after / scaled, 3), "steps_measured": [n_before, n_after, n_fresh],
            "plan_after": layout, "policy": rec.get("policy")}


def _fresh_run(lab: Lab, hosts: int, lose: int, layout: dict, window: int, skip: int, out: Path) -> tuple[float, int]:
    """Steady tokens/s (and steps measured) of a new run on the hosts left, at ``layout``."""
    cfg = demo_config(window + skip + 2, f"lab-thr-fresh-{hosts}-{lose}", parallel=layout,
                      train={"global_batch_size": 48, "micro_batch_size": 4},
                      checkpoint={"memory_every": 5}, failure=FAILURE, balance={"mode": "off"})
    result = LabRun(lab, cfg, out.parent / f"{out.name}-fresh").result()
    if "error" in result:
        raise RuntimeError(f"throughput {hosts}-{lose}: the fresh run on the survivors failed: {result['error']}")
    return _tokens_per_s(result["history"], 0, skip)


def _burner(lab: Lab, host) -> object:
    return lab.spawn(host, [sys.executable, "-c", "while True: pass"], log="burner")


def suspicion_round(lab: Lab, steps: int, out: Path) -> dict:
    """A run on 4 hosts at dp=2 x pp=2 with a CPU burner on one of them throughout."""
    cfg = demo_config(steps, "lab-suspect", parallel={"dp": 2, "pp": 2}, checkpoint={"memory_every": 5},
                      failure=FAILURE)
    run = LabRun(lab, cfg, out)
    ranks = run.await_step(1)
    loaded = lab.host_at(ranks[3])
    burner = _burner(lab, loaded)
    t0 = time.time()
    try:
        result = run.result()
    finally:
        burner.kill()
        burner.wait()
    if "error" in result:
        raise RuntimeError(f"suspicion: the run failed: {result['error']}")
    suspected = [e for e in result["events"] if e["kind"] == "failure" and e["failure"] == "silent"]
    fences = [e for e in result["events"] if e["kind"] == "fence"]
    readmitted = {e["worker"] for e in fences if e.get("outcome") == "readmitted"}
    stragglers = [e for e in result["events"] if e["kind"] == "straggler"]
    return {"steps": steps, "seconds_loaded": round(time.time() - t0, 1), "suspected": len(suspected),
            "answered_again": len({e["worker"] for e in suspected} & readmitted),
            "killed_for_silence": sum(1 for e in fences if e.get("outcome") == "killed"),
            "straggler_events": len(stragglers), "recoveries": len(result["recoveries"]),
            "state": result["state"]}
