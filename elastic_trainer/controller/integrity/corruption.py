"""Silent data corruption: found by comparing replicas, proven by replay, fenced by quarantine.

Every ``integrity.check_every`` steps (``auto``: as often as keeps the checks under
``check_max_overhead`` of the step time, from their measured cost), at a durable checkpoint's
step and at the last, the ranks fingerprint their state after the update
(``worker.state_checks``) and this compares each stage's replicas (``compare``). A step whose
check passed is *verified*, and so is every step before it: replicas that part (a bit flipped in
one) never meet again by themselves, so agreeing at a step means they agreed all along. The
newest snapshot at or before the last verified step is one every replica agreed on.

A mismatch blames nobody yet. The run goes back to that snapshot on the same plan and replays
the steps to the mismatched one, checked again (``prove``): the rank that cannot reproduce its
own result, or that disagrees with the replicas' majority, is the suspect. Its node is
quarantined: nothing is started there again, its ranks move to a spare (or the plan shrinks)
at the next snapshot step, and ``status`` and the metrics name it. The run continues from the
replayed state, which every replica agrees on. A sharded optimizer's rank whose slice changed
at rest (its own checksum, ``integrity.verdict``) is proven by that checksum: quarantined at
once, and the run goes back to the last verified snapshot.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
import time

from ...config import TrainerConfig
from ...config.runtime import MEETING_SYNCS
from ...errors import RunError
from ...integrity.state_fingerprint import differing
from ...parallel.topology import Topology
from ..run.orders import ReplanOrder
from ..run.run_record import RunRecord
from ..run.run_state import RunState
from ..run.workers import WorkerPool
from ..stepping.one_step import StepOutcome

log = logging.getLogger(__name__)

_FIRST_EVERY = 10     # check_every auto, before a check's cost is measured
_MOST_EVERY = 1000
# How long a quarantine's re-plan waits for the replacement started for it (then it shrinks).
QUARANTINE_WAIT_S = 60.0


def compared_parts(cfg: TrainerConfig, sharded: bool, step: int) -> tuple[str, ...]:
    """What replicas of a stage hold bit for bit after ``step``: parameters and optimizer state
    (all-reduce, unsharded); parameters only (a sharded optimizer's slices are each rank's own;
    a parameter server keeps the optimizer); parameters right after a meeting of local steps or
    DiLoCo, nothing between meetings."""
    comm = cfg.comm
    if comm.sync in MEETING_SYNCS:
        return ("params",) if step % comm.local_steps == 0 else ()
    if comm.sync == "parameter_server" or sharded:
        return ("params",)
    return ("params", "optim")


def compare(fps: dict[int, dict], topo: Topology, parts: tuple[str, ...]) -> list[dict]:
    """Each stage whose replicas' fingerprints (rank -> ``StateChecks.fingerprint``) differ in
    ``parts``: ``{"stage", "groups": [[ranks alike], ...] (largest first), "keys": [differing]}``."""
    out = []
    for stage in range(topo.pp):
        ranks = [topo.rank(d, stage) for d in range(topo.dp) if topo.rank(d, stage) in fps]
        if len(ranks) < 2:
            continue
        groups: dict[tuple, list[int]] = collections.defaultdict(list)
        for r in ranks:
            groups[_key(fps[r], parts)].append(r)
        if len(groups) > 1:
            alike = sorted(groups.values(), key=lambda g: (-len(g), g))
            keys = differing(_flat(fps[alike[0][0]], parts), _flat(fps[alike[1][0]], parts))
            out.append({"stage": stage, "groups": alike, "keys": keys})
    return out


def suspects(orig: dict[int, dict], replay: dict[int, dict], parts: tuple[str, ...]) -> tuple[list[int], str]:
    """The ranks a replay proves at fault (``orig``, ``replay``: rank -> fingerprints of one
    stage's replicas at the same step), and the proof in words. A rank is at fault where it could
    not reproduce its own result, or where its replayed result is not the majority's; with no
    majority, the result a rank reproduced is the reference."""
    same = {r: _key(orig[r], parts) == _key(replay[r], parts) for r in orig if r in replay}
    counts = collections.Counter(_key(replay[r], parts) for r in same)
    top = counts.most_common()
    if len(top) == 1 or top[0][1] > top[1][1]:
        ref = top[0][0]
    else:
        held = {_key(replay[r], parts) for r, ok in same.items() if ok}
        if len(held) != 1:
            return [], (f"unresolved: ranks {sorted(same)} disagree again in the replay and none is the "
                        "majority or alone in reproducing its result")
        ref = held.pop()
    if not any(same.values()):
        # The corruption reached every replica before the check (through the gradients it fed into
        # the steps after it): nobody reproduces, and the replay, which agrees, undid it.
        return [], (f"unresolved: no rank of {sorted(same)} reproduced its result (the corruption fed the "
                    "gradients every replica applied before the check); the replay agrees and undid it")
    bad = sorted(r for r, ok in same.items() if not ok or _key(replay[r], parts) != ref)
    good = sorted(r for r in same if r not in bad)
    why = []
    for r in bad:
        why.append(f"rank {r} " + ("could not reproduce its own result" if not same[r]
                                   else "reproduced a result the others do not hold"))
    return bad, "; ".join(why) + (f"; ranks {good} reproduced theirs and agree" if good else "")


def _flat(fp: dict, parts: tuple[str, ...]) -> dict:
    return {f"{p}:{k}": v for p in parts for k, v in (fp.get(p) or {}).items()}


def _key(fp: dict, parts: tuple[str, ...]) -> tuple:
    return tuple(sorted(_flat(fp, parts).items()))


class Corruption:
    """The check schedule, the comparisons, the proofs and the quarantined nodes of a run."""

    def __init__(self, cfg: TrainerConfig, run: RunRecord, pool: WorkerPool, request_replan, median_step_s):
        """``request_replan(reason)``: growth's re-plan at the next snapshot step (the quarantine's
        move); ``median_step_s()``: the step time under the plan in force (``auto``'s yardstick)."""
        self.cfg, self.run, self.pool = cfg, run, pool
        self._replan, self._step_s = request_replan, median_step_s
        every = cfg.integrity.check_every
        self.fixed = None if every == "auto" else int(every)
        self.costs: collections.deque[float] = collections.deque(maxlen=20)   # seconds a check took (slowest rank)
        self.forced: set[int] = set()        # steps checked whatever the interval (a proof's replay)
        self.verified = 0                    # the newest step whose check passed (0: the start)
        self.failed: set[int] = set()        # steps whose check found a mismatch (no durable write)
        self.proof: dict | None = None       # a mismatch being proven: its step, stage, first results
        self.checks_run = 0

    # -- the schedule ------------------------------------------------------------------------
    def interval(self) -> int:
        """Steps between checks now (0: off)."""
        if self.fixed is not None:
            return self.fixed
        step_s = self._step_s()
        if not self.costs or not step_s:
            return _FIRST_EVERY
        want = statistics.median(self.costs) / (self.cfg.integrity.check_max_overhead * step_s)
        return max(1, min(_MOST_EVERY, math.ceil(want)))

    def checks(self, first: int, count: int, snapshot: bool) -> list[int]:
        """The steps of a call from ``first`` (``count`` of them) whose state the ranks fingerprint:
        every ``interval``-th, the forced ones, a durable checkpoint's step and the run's last (what
        is saved is saved verified). ``snapshot``: whether the call's last step takes one (a
        snapshot needs no check of its own: one at or before the last passed check is verified,
        since replicas that part never meet again)."""
        every = self.interval()
        if every == 0 and not self.forced:
            return []
        last = first + count - 1
        durable = self.cfg.checkpoint.durable_every if self.cfg.checkpoint.storage else None
        out = [s for s in range(first, last + 1)
               if (every and (s % every == 0 or (durable and s % durable == 0) or s == self.cfg.train.steps))
               or s in self.forced]
        return out

    def durable_ok(self, step: int) -> bool:
        """Whether a durable checkpoint of ``step`` may be written: its check did not fail."""
        return step not in self.failed

    # -- a committed step ------------------------------------------------------------------------
    def observe(self, out: StepOutcome) -> ReplanOrder | None:
        """Compare a committed step's fingerprints, if it was checked: None, or the replay's
        re-plan a mismatch calls for."""
        run = self.run
        fps = {o["rank"]: o["fingerprints"] for o in out.results.values() if o.get("fingerprints")}
        if not fps:
            return None
        self.checks_run += 1
        self.costs.append(max(o.get("check_s") or 0.0 for o in out.results.values()))
        topo = run.plan.topology
        parts = compared_parts(self.cfg, run.plan.shard_optimizer != "none" and topo.dp > 1, out.step)
        if self.proof is not None:
            # The steps after a mismatch, run before its replay began, are rolled back by it.
            return self._conclude(out, fps, topo, parts) if out.step == self.proof["step"] else None
        found = compare(fps, topo, parts) if parts else []
        if not found:
            self.verified = out.step
            return None
        self.failed.add(out.step)
        bad = found[0]
        self.proof = {"step": out.step, "stage": bad["stage"], "groups": bad["groups"], "keys": bad["keys"][:8],
                      "orig": {r: fps[r] for g in bad["groups"] for r in g}, "from": self.verified,
                      "detected": time.perf_counter()}
        self.forced.add(out.step)
        log.warning("[%s] step %d: the replicas of stage %d disagree (%s; ranks alike: %s): replaying from "
                    "step %d to prove which", run.name, out.step, bad["stage"], ", ".join(bad["keys"][:3]),
                    bad["groups"], self.verified)
        return ReplanOrder("corruption", time.perf_counter(), failed=out, plan_before=run.plan.describe(),
                           restore_at_most=self.verified)

    def _conclude(self, out: StepOutcome, fps: dict, topo: Topology, parts: tuple[str, ...]) -> ReplanOrder | None:
        proof, self.proof = self.proof, None
        self.forced.discard(out.step)
        orig = proof["orig"]
        bad, why = suspects(orig, {r: fps[r] for r in orig if r in fps}, parts)
        agree = not compare(fps, topo, parts)
        if not bad:
            self.run.event("corruption", step=proof["step"], stage=proof["stage"], keys=proof["keys"],
                           groups=proof["groups"], suspects=[], proof=why, agreed_step=proof["from"],
                           quarantined=[])
            if not agree:
                raise RunError(f"step {proof['step']}: the replicas of stage {proof['stage']} disagree "
                               f"({proof['keys'][:3]}) and so do they after a replay from step {proof['from']}: {why}")
            log.warning("[%s] step %d: %s", self.run.name, proof["step"], why)
            self.failed.discard(out.step)
            self.verified = out.step
            return None
        self.failed.discard(out.step)
        if agree:
            self.verified = out.step
        self.quarantine(bad, step=proof["step"], stage=proof["stage"], keys=proof["keys"], groups=proof["groups"],
                        proof=f"replay of steps {proof['from'] + 1}..{proof['step']}: {why}",
                        agreed_step=proof["from"], detect_to_proof_s=round(time.perf_counter() - proof["detected"], 3))
        return None

    def proven(self, mark: dict, out: StepOutcome) -> ReplanOrder:
        """A sharded slice found changed at rest (an anomaly mark of kind ``corruption``): proven
        by its own checksum. Quarantined now, and the run goes back to the last verified step."""
        a = mark["anomaly"]
        self.quarantine(a.get("ranks") or [], step=mark["step"], stage=None, keys=[], groups=[],
                        proof="checksum: its state changed between its check and its next update, while "
                              "nothing wrote it", agreed_step=self.verified)
        self.run.transition(RunState.RECOVERING, step=mark["step"])
        out.step = mark["step"]
        return ReplanOrder("corruption", time.perf_counter(), failed=out, plan_before=self.run.plan.describe(),
                           restore_at_most=self.verified)

    def quarantine(self, ranks: list[int], **detail) -> None:
        """The nodes of ``ranks``' workers: no worker is started there again, and their ranks move
        off at the next snapshot step (to a spare started now, where the cluster has room)."""
        run, pool = self.run, self.pool
        wids = [run.ranks[r] for r in ranks if r in run.ranks]
        nodes = sorted({pool[w].node for w in wids if w in pool and pool[w].node})
        why = f"corruption at step {detail.get('step')}"
        if any(h.node not in nodes for h in pool.handles()):
            for node in nodes:
                pool.quarantine(node, why)
            workers = []
        else:
            # Every worker of the run is there (one machine): its node stays, the workers go (their
            # devices are the likelier culprits), replaced on it.
            nodes, workers = [], wids
            pool.quarantined_workers.update(wids)
        pool.spawn_on_free_nodes()
        if nodes or workers:
            self._replan("quarantine")
        run.event("corruption", suspects=sorted(ranks), workers=wids, nodes=nodes, quarantined=nodes,
                  quarantined_workers=workers, **detail)
        log.warning("[%s] corruption at step %s: ranks %s (workers %s) proven at fault (%s); nodes %s quarantined",
                    run.name, detail.get("step"), sorted(ranks), wids, detail.get("proof"), [n[:12] for n in nodes])
