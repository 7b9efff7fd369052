"""What the heartbeat costs the controller as the nodes grow, asked directly and through relays.

The real ``controller.heartbeat.Heartbeat`` watches M nodes for ``--seconds``
at ``failure.heartbeat_timeout_s`` ``--timeout``, as it watches a lease: one
worker a node, each a small threaded actor that answers ``ping_node`` and
``relay_pings`` with the workers' own code (``worker.heartbeat_relay``); a
node of one worker has no node-mates to read in /proc. This host cannot hold
a train worker per node past a few dozen, so the actors stand in for them:
what is measured is the controller's side, which does not know the
difference. For each M and each fanout (``--fanouts``; one past M is every
node asked directly) it reports the controller's questions a second and its
process's CPU a second (a share of a core). Then one node is frozen (its
actor SIGSTOPped) and the time until the heartbeat names it is read, with
any other node it named (there should be none).

    python benchmarks/heartbeat.py --nodes 16,48,96 --fanouts 0,16
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from elastic_trainer.controller.stepping.heartbeat import Heartbeat  # noqa: E402
from elastic_trainer.worker.heartbeat_relay import relay_pings  # noqa: E402


@ray.remote(num_cpus=0, concurrency_groups={"control": 4})
class NodeWorker:
    def __init__(self, wid: int):
        self.wid = wid

    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def ping_node(self, mates: dict) -> dict:
        return {}

    @ray.method(concurrency_group="control")
    def relay_pings(self, asks: dict, wait_s: float) -> dict:
        return relay_pings(asks, wait_s, self.wid, self.ping_node)


def watch(actors: dict, fanout: int, timeout: float, seconds: float) -> dict:
    """Run the heartbeat's rounds for ``seconds`` (or until it names someone, when a node is
    frozen); the controller's CPU and questions a second, and whom it named when."""
    where = {w: (f"node{w}", None, None) for w in actors}
    beat = Heartbeat(timeout, time.perf_counter(), actors, lambda w: where[w], fanout)
    pending = list(actors)
    sent, named, named_at = 0, [], None
    c0, t0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        wait = max(0.0, beat.next_at - time.perf_counter())
        if beat.refs:
            ready, _ = ray.wait(list(beat.refs), num_returns=len(beat.refs), timeout=wait)
            for ref in ready:
                beat.answer(ref)
        else:
            time.sleep(wait)
        if time.perf_counter() >= beat.next_at:
            named = beat.tick(pending)
            sent += beat.sent_last
            if named:
                named_at = time.perf_counter()
                break
    wall = time.perf_counter() - t0
    return {"questions_per_s": sent / wall, "cpu_share": (time.process_time() - c0) / wall,
            "named": named, "named_after_s": None if named_at is None else named_at - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="16,48,96")
    ap.add_argument("--fanouts", default="0,16", help="comma-separated; 0: every node asked directly")
    ap.add_argument("--timeout", type=float, default=1.0, help="failure.heartbeat_timeout_s")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "heartbeat.json"))
    args = ap.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for m in [int(x) for x in args.nodes.split(",")]:
            for fanout in [int(x) for x in args.fanouts.split(",")]:
                fo = fanout or m + 1
                actors = {w: NodeWorker.remote(w) for w in range(m)}
                pids = ray.get([a.pid.remote() for a in actors.values()])
                steady = watch(actors, fo, args.timeout, args.seconds)
                victim = m // 2
                os.kill(pids[victim], signal.SIGSTOP)
                try:
                    caught = watch(actors, fo, args.timeout, 10 * args.timeout)
                finally:
                    os.kill(pids[victim], signal.SIGCONT)
                row = {"nodes": m, "fanout": fanout or "direct", **{k: steady[k] for k in ("questions_per_s", "cpu_share")},
                       "named": caught["named"], "frozen": victim, "named_after_freeze_s": caught["named_after_s"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
                for a in actors.values():
                    ray.kill(a)
    finally:
        ray.shutdown()
    print(f"\nheartbeat timeout {args.timeout:g} s, steady for {args.seconds:g} s")
    print("\n| nodes | asked | controller questions/s | controller CPU (share of a core) | frozen node named after | others named |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        asked = "directly" if r["fanout"] == "direct" else f"through relays of {r['fanout']}"
        others = [w for w in r["named"] if w != r["frozen"]]
        print(f"| {r['nodes']} | {asked} | {r['questions_per_s']:.1f} | {r['cpu_share']:.1%} | "
              f"{r['named_after_freeze_s'] or float('nan'):.2f} s | {others or 'none'} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
