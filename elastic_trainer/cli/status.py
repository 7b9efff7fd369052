"""``elastic-trainer status`` and ``stop``: the live runs on a cluster, through their controllers."""

from __future__ import annotations

import time

from ..errors import error_line
from ..controller.run.goodput import lost_line
from ..naming import NAMESPACE, is_controller

_ANSWER_TIMEOUT_S = 10.0


def live_statuses(run: str | None = None) -> list[dict]:
    """Status of every live run's controller (one run with ``run``), on the connected cluster.

    A controller that does not answer in time is reported as such rather than
    hiding the others.
    """
    import ray

    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a.get("namespace") == NAMESPACE and is_controller(a["name"]))
    if run is not None:
        names = [n for n in names if n == f"{run}-controller"]
    refs = {n: ray.get_actor(n, namespace=NAMESPACE).status.remote() for n in names}
    out = []
    for name, ref in refs.items():
        try:
            out.append(ray.get(ref, timeout=_ANSWER_TIMEOUT_S))
        except Exception as e:  # a controller that died or is stuck still belongs in the list
            out.append({"run": name[: -len("-controller")], "state": "UNREACHABLE",
                        "error": error_line(e)})
    return out


def stop_run(run: str, reason: str = "") -> bool | None:
    """Ask the live run ``run`` to stop at its next step boundary (``Controller.stop``): True when
    the request was taken, False when a stop was asked already or the run has ended, None when
    no live run has that name."""
    import ray

    try:
        controller = ray.get_actor(f"{run}-controller", namespace=NAMESPACE)
    except ValueError:
        return None
    return ray.get(controller.stop.remote(reason), timeout=_ANSWER_TIMEOUT_S)


def format_status(st: dict) -> str:
    """A few lines per run: state, step, throughput, plan with each rank's node, last failures."""
    head = f"run {st['run']}: {st['state']}"
    if st["state"] == "STOPPED":
        head += f" at step {st['step']} of {st['steps']} (stopped before the last step; what it had is saved)"
    elif st.get("stopping") and st["state"] not in ("FINISHED", "FAILED"):
        head += f" (stop requested at step {st['stopping']['step']}: ending after the steps in flight)"
    lines = [head]
    if "error" in st:
        lines.append(f"  controller did not answer: {st['error']}")
        return "\n".join(lines)
    step_line = f"  step {st['step']}/{st['steps']}"
    if st.get("last"):
        step_line += f", loss {st['last']['loss']:.4f}"
        if st["last"].get("lr") is not None:
            step_line += f", lr {st['last']['lr']:.3g}"
    if st.get("tokens_per_s"):
        step_line += f", {st['tokens_per_s']:,.0f} tok/s, {st['step_time_s'] * 1000:.1f} ms/step"
        if not st.get("stopping") and st["state"] != "STOPPED":   # a stopped run has no time left to run
            left = (st["steps"] - st["step"]) * st["step_time_s"]
            step_line += f", ~{left / 60:.1f} min left"
    lines.append(step_line)
    if st.get("eval"):
        lines.append(f"  validation loss {st['eval']['loss']:.4f} after step {st['eval']['step']}")
    plan = st.get("plan")
    if plan:
        stages = ", ".join(f"stage {s['stage']}: blocks {s['blocks'][0]}..{s['blocks'][1] - 1}"
                           for s in plan["stages"])
        lines.append(f"  plan dp={plan['dp']} x pp={plan['pp']} (world {plan['world_size']}); {stages}")
    if st.get("setting_up"):
        up = st["setting_up"]
        lines.append(f"  setting up dp={up['dp']} x pp={up['pp']} on workers "
                     f"{', '.join(str(w) for _, w in sorted(up['workers'].items()))}")
    by_rank = sorted((w for w in st.get("workers", []) if w["rank"] is not None), key=lambda w: w["rank"])
    pace, slow = st.get("pace") or {}, st.get("stragglers") or {}
    memory = st.get("memory") or {}
    step_peak, setup = memory.get("step_peak_rss_bytes") or {}, memory.get("setup") or {}
    device_peak = memory.get("step_peak_device_bytes") or {}
    for w in by_rank:
        p = pace.get(str(w["rank"]))
        peak, on_device = step_peak.get(str(w["rank"])), device_peak.get(str(w["rank"]))
        at_setup = (setup.get(w["rank"]) or setup.get(str(w["rank"])) or {}).get("setup_peak_rss_bytes")
        lines.append(f"    rank {w['rank']}: worker {w['worker_id']} pid {w['pid']} node {str(w['node_id'])[:12]}"
                     + (f" pace {p:.2f}" if p is not None else "")
                     + (f" memory {peak / 2**20:.0f} MiB" if peak else "")
                     # How to read that figure: jemalloc keeps freed memory (worker.allocator).
                     + (f" on {w['allocator']}" if peak and w.get("allocator") else "")
                     + (f" device {on_device / 2**20:.0f} MiB" if on_device else "")
                     + (f" (set-up peak {at_setup / 2**20:.0f} MiB)" if at_setup else "")
                     + (f" STRAGGLER since step {slow[w['rank']]}" if w["rank"] in slow else ""))
    if st.get("shares"):
        lines.append(f"    micro-batches per replica (balancing): {st['shares']}")
    for b in st.get("benched") or []:
        lines.append(f"    benched straggler: worker {b['worker']} (was rank {b['rank_before']}, pace {b['pace']:.2f}) "
                     f"since step {b['since_step']}")
    spares = [w for w in st.get("workers", []) if w["rank"] is None]
    if spares:
        lines.append(f"    spares: {', '.join(str(w['worker_id']) for w in spares)}")
    starting = st.get("starting") or []
    if starting:
        lines.append("    starting: " + ", ".join(f"worker {w['worker_id']} on node {str(w['node_id'])[:12]}"
                                                + (" (up, joins at the next look)" if w["ready"] else "")
                                                for w in starting))
    if st.get("goodput"):
        lines.append("  " + lost_line(st["goodput"]))
    fails = st.get("failures") or []
    lines.append(f"  failures: {len(fails)} recent, {st.get('recoveries', 0)} recoveries")
    for f in fails:
        when = time.strftime("%H:%M:%S", time.localtime(f["time"])) if f.get("time") else "?"
        lines.append(f"    {when} step {f['step']}: {f['failure']} of worker {f['worker']}"
                     + (f" (rank {f['rank']})" if f.get("rank") is not None else ""))
    return "\n".join(lines)
