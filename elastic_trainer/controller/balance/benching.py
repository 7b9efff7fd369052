"""A straggler left out as a spare: benched, re-planned around, probed, and let back in.

The last of ``balance``'s mitigations (``Balance.act`` decides when it
repays). Benching a worker is a live re-plan without it, taken like a grow:
the next step takes a snapshot, and the re-plan after it restores that step,
so nothing is redone. The benched worker stays alive and holds no rank; the
policy and the grow check count only the workers that are not benched.

A benched worker runs no steps, so its pace is read from a probe instead
(``worker.probe``): right after the re-plan (its slow baseline), and every
``balance.window`` steps after, each time beside the same probe on a running
worker (rank 0's), and read against it: a host whose load changes for
everyone (the probe's own host, on a shared machine) moves both alike, and
only the benched worker's own recovery moves the ratio. It is let back in
once it has won back at least half its slowdown against the peer (on a log
scale: 2x of a 4x slowdown) and more than ``balance.threshold``: read alone,
a probe taken as a burst of load ended ran 15% faster than its baseline while
the worker was still 20 times slower, and beside a busy peer on this shared
host the ratio moved 1.3x from noise alone; each time it was let back in too
soon. Once let back in, the grow check re-plans onto it when the policy prefers the larger plan; if it is still slow
there, it is named and priced again like any straggler. (Its pace when
benched is not the yardstick: read on fewer micro-batches it can overstate
the slowdown, 3.25 for a 2x straggler in the benchmark, and a worker back to
full speed would never have matched it.) A worker that dies while benched is
dropped like any other.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

import ray

from ...config import TrainerConfig
from ..run.run_record import RunRecord
from ..run.workers import WorkerPool

log = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 30.0
_RESET_WAIT_S = 10.0


@dataclass
class Benched:
    wid: int
    rank: int            # the rank it held
    pace: float          # its pace when it was benched
    step: int            # the step it was benched after
    probe_s: float | None = None   # its probe once it ran no steps (the slow baseline)
    products: int | None = None    # the probe's size, fixed at the baseline
    last_probe_s: float | None = None
    peer_s: float | None = None    # a running peer's probe beside the baseline (None: read alone)
    failed_probes: int = 0         # in a row; a worker that fails _MAX_FAILED_PROBES is let go


_MAX_FAILED_PROBES = 2


class Bench:
    def __init__(self, cfg: TrainerConfig, run: RunRecord, pool: WorkerPool):
        self.cfg, self.run, self.pool = cfg, run, pool
        self.benched: dict[int, Benched] = {}
        self._lock = threading.Lock()   # status() reads it from another thread
        self._probed_at = 0

    def usable(self) -> list[int]:
        """The live workers a plan may use: all but the benched, and those on a draining or a
        quarantined node."""
        with self._lock:
            benched = set(self.benched)
        return sorted(w for w, h in list(self.pool.workers.items())
                      if w not in benched and not self.pool.leaving(h.node, w))

    def bench(self, rank: int, pace: float, step: int) -> int | None:
        """Leave out the worker of ``rank``; its id, for the caller to re-plan without it (a
        ``straggler`` re-plan), or None when it cannot be left out (its worker is gone)."""
        wid = self.run.ranks.get(rank)
        if wid is None or wid not in self.pool:
            return None
        with self._lock:
            self.benched[wid] = Benched(wid, rank, pace, step)
        return wid

    def readmit_all(self, why: str) -> list[dict]:
        """Let every benched worker back in at once (no plan fits without them); their events."""
        with self._lock:
            back, self.benched = list(self.benched.values()), {}
        step = self.run.step
        return [{"kind": "rebalance", "step": step, "action": "readmit", "worker": b.wid,
                 "rank_before": b.rank, "benched_steps": step - b.step, "reason": why} for b in back]

    def after_replan(self, step: int, reset_refs: dict) -> None:
        """Take the slow baseline of each newly benched worker, now that it runs no steps (once
        its reset has ended, which would otherwise share its device with the probe; ``reset_refs``:
        worker id -> its last reset)."""
        self._drop_gone()
        fresh = [b for b in self.benched.values() if b.probe_s is None]
        resets = [reset_refs[b.wid] for b in fresh if b.wid in reset_refs]
        if resets:
            ray.wait(resets, num_returns=len(resets), timeout=_RESET_WAIT_S)
        self._baseline(fresh)
        self._probed_at = step

    def _baseline(self, fresh: list[Benched]) -> None:
        for b, got in zip(fresh, self._probe([(b.wid, None) for b in fresh])):
            if got is not None:
                b.probe_s, b.products = got   # sized alone; then timed beside the peer
                b.last_probe_s = b.probe_s
                pair = self._beside_peer(b)
                if pair is not None:
                    b.probe_s, b.peer_s = pair
                    b.last_probe_s = b.probe_s

    def _peer(self) -> int | None:
        """A running worker to probe beside a benched one: rank 0's, else the lowest rank's."""
        with self._lock:
            benched = set(self.benched)
        ranked = sorted((r, w) for r, w in self.run.ranks.items() if w in self.pool and w not in benched)
        return ranked[0][1] if ranked else None

    def _beside_peer(self, b: Benched) -> tuple[float, float] | None:
        """(the benched worker's probe, a running peer's) timed at once, on the same workload;
        None where there is no peer or either probe failed."""
        peer = self._peer()
        if peer is None:
            return None
        mine, theirs = self._probe([(b.wid, b.products), (peer, b.products)])
        if mine is None or theirs is None:
            return None
        return mine[0], theirs[0]

    def poll(self, step: int) -> list[dict]:
        """Every ``balance.window`` steps, probe the benched workers; returns the ``rebalance``
        events of those let back in."""
        self._drop_gone()
        if not self.benched or step - self._probed_at < self.cfg.balance.window:
            return []
        self._probed_at = step
        self._baseline([b for b in self.benched.values() if b.probe_s is None])   # a baseline that failed
        ready = [b for b in self.benched.values() if b.probe_s is not None]
        events = []
        faster = 1 + self.cfg.balance.threshold
        for b in ready:
            pair = self._beside_peer(b) if b.peer_s is not None else None
            if pair is None:
                got = self._probe([(b.wid, b.products)])[0]
                if got is None:
                    continue
                s, peer_s = got[0], None
                speedup, need = b.probe_s / s, faster
            else:
                s, peer_s = pair
                slowdown = b.probe_s / b.peer_s   # how much slower than the peer it was benched
                speedup = slowdown / (s / peer_s)
                # At least half its slowdown won back (on a log scale), and the threshold: a probe
                # read beside a busy peer on a shared host moved 1.3x from noise alone.
                need = max(faster, math.sqrt(max(slowdown, 1.0)))
            b.last_probe_s = s
            now = b.pace / speedup   # its pace now, as far as the probe tells
            expired = step - b.step >= self.cfg.balance.payback_steps
            if speedup >= need or expired:
                with self._lock:
                    del self.benched[b.wid]
                events.append({"kind": "rebalance", "step": step, "action": "readmit", "worker": b.wid,
                               "rank_before": b.rank, "benched_steps": step - b.step, "pace": round(now, 3),
                               "probe_s": round(s, 6), "probe_s_benched": round(b.probe_s, 6),
                               "peer_probe_s": round(peer_s, 6) if peer_s is not None else None,
                               "peer_probe_s_benched": round(b.peer_s, 6) if peer_s is not None else None,
                               "speedup": round(speedup, 3), "speedup_needed": round(need, 3),
                               "reason": "benched for balance.payback_steps: tried again" if expired
                               and speedup < need else "its probe is faster"})
                log.info("[%s] worker %d probes %.1fx faster than when benched%s (%.1fx needed), after %d steps: "
                         "it may be grown onto", self.run.name, b.wid, speedup,
                         " against a running peer" if peer_s is not None else "", need, step - b.step)
        return events

    def _drop_gone(self) -> None:
        with self._lock:
            for wid in [w for w in self.benched if w not in self.pool]:
                del self.benched[wid]   # died while benched

    def _probe(self, asks: list[tuple[int, int | None]]) -> list[tuple[float, int] | None]:
        """(seconds, products) per worker in ``asks`` ((worker, products)), all probed at once; None
        where a probe failed. A dead worker is dropped from the pool (and so from the bench)."""
        pool = self.pool
        refs = {w: pool[w].actor.probe.remote(n) for w, n in asks if w in pool}
        if refs:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=_PROBE_TIMEOUT_S)
        out = []
        for w, _ in asks:
            try:
                seconds, products = ray.get(refs[w], timeout=0)
                out.append((float(seconds), int(products)))
            except Exception:  # noqa: BLE001 - dead, hung or gone: dead ones are dropped below
                out.append(None)
        failed = [w for (w, _), got in zip(asks, out) if got is None and w in pool]
        gone = set(pool.dead_among(failed))
        for (w, _), got in zip(asks, out):
            b = self.benched.get(w)
            if b is not None:
                b.failed_probes = 0 if got is not None else b.failed_probes + 1
                if b.failed_probes >= _MAX_FAILED_PROBES:
                    gone.add(w)   # alive but its probes hang or fail: it is no use as a spare either
        if gone:
            log.warning("[%s] letting benched worker(s) %s go: dead, or their probes failed %d times",
                        self.run.name, sorted(gone), _MAX_FAILED_PROBES)
            pool.drop(sorted(gone))
            self._drop_gone()
        return out

    def describe(self) -> list[dict]:
        with self._lock:
            benched = list(self.benched.values())
        return [{"worker": b.wid, "rank_before": b.rank, "pace": round(b.pace, 3), "since_step": b.step,
                 "probe_s": b.last_probe_s} for b in benched]
