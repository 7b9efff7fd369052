"""The controller's side of stragglers: each step's per-rank compute into pace, events, and the
rebalancing around a slow rank.

``pace`` is the pure part (``PaceTracker``); this joins it to the run: a new
plan resets it (ranks and stages change), every committed step's record gets
``rank_compute_s`` and ``rank_wait_s`` (each rank's own compute and its wait,
``worker.compute_clock``) and ``pace`` (each rank's median pace), which leave
the record for ``rank_figures`` when it commits, and a rank that turns slow or
recovers is an event naming its worker and node.

A rank's pace is taken from what its step would take on the equal share of
micro-batches (``compute_at_equal_share``: its passes as run plus the calls it did not
run at their steady cost, and its update), so a rank given fewer
micro-batches keeps the pace it has, and one that recovers shows it. ``rank_compute_s`` in the record is
what it did take.

With ``balance.mode: act``, cheapest first:

- a straggler in a run of several replicas that average gradients by
  all-reduce moves micro-batches off its replica onto the others
  (``shares``): the global batch and the update stay the same
  (``StageTrainer.train_step`` weights gradients by samples). The shares are
  the ones that minimise the planner's step time re-priced under the
  measured paces (``planning.balancing``), taken only when the predicted gain
  repays their cost (about one step: the replicas' next step builds a
  schedule for its count) within ``balance.payback_steps``. They are looked
  at again every ``window`` steps while a straggler lasts, and go back to
  equal once every rank they were for has recovered;
- in a pipeline, where no share helps, a clear and lasting straggler's stage
  is given fewer blocks (``Moves.cut``, a live re-plan with every rank on
  its worker): the cut that minimises the slowest stage under the measured
  stage paces (``planning.recut``), when that repays two re-plans (there
  and back) within ``payback_steps``. The balanced cut comes back once every
  rank it was for has recovered. Paces stay those of the balanced cut (each
  rank's compute scaled by its stage's modelled work there over now), so the
  re-cut rank still reads slow until it is not;
- where neither helps, a clear and lasting straggler is left out as a spare
  (``Moves.bench``, carried out by ``controller.benching``) when the
  policy's plan without it repays two re-plans within ``payback_steps``.

A new plan starts on equal shares. The same workers on the same layout (a
re-cut, a retry in place) keep their paces.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Callable

from ...config import BalanceSection
from ...planning.balancing import predict_step_s, propose_shares
from ...planning.recut import propose_recut, stage_work
from .compute_at_equal_share import EqualShare
from .pace import PaceTracker

Bounds = tuple[tuple[int, int], ...]
# Steps on a new cut that set each rank's scale (``Balance._calibrate``), and the most that
# scale may move from the modelled one: a one-block stage holding a head the model prices at a
# third of its cost is 2x off. A larger change is the rank's speed changing (a 3x straggler
# that recovered during the re-plan); a smaller one is absorbed until the cut expires
# (``payback_steps``) and is measured again at the balanced cut.
_CALIBRATION_STEPS = 4
_MODEL_ERROR = 2.5


class Moves(list):
    """One step's ``rebalance`` events (a list), and the re-plan they ask the step loop to take:
    ``bench`` = (rank, pace) to leave out as a spare, ``cut`` = the stage bounds to re-cut to.
    A decision handed back as a value: nothing is left on ``Balance`` for the loop to poll."""

    def __init__(self, events=(), bench: tuple[int, float] | None = None, cut: "Bounds | None" = None):
        super().__init__(events)
        self.bench, self.cut = bench, cut


class Balance:
    def __init__(self, cfg: BalanceSection, sync: str = "allreduce",
                 spare_plan: Callable[[], object | None] | None = None,
                 replan_cost_s: Callable[[], float] | None = None,
                 cut_fits: Callable[[Bounds], bool] | None = None):
        """``spare_plan``: the policy's choice (``PlanChoice``) on the usable workers less one,
        None where there is none; ``replan_cost_s``: what a live re-plan costs, as measured;
        ``cut_fits``: whether the current layout cut so fits a worker's memory."""
        self.cfg = cfg
        self.on = cfg.mode != "off"
        self.acts = cfg.mode == "act"
        self.shares_ok = sync == "allreduce"   # the other sync modes average models, not gradients
        self._spare_plan, self._replan_cost_s, self._cut_fits = spare_plan, replan_cost_s, cut_fits
        self._bench_pending: tuple[int, float] | None = None   # (rank, pace) left out, its re-plan not yet taken
        self._decided: tuple | None = None                       # what this act() asks the loop for: (bench, cut)
        self._bounds: Bounds | None = None       # the plan's stage cut
        self._balanced: Bounds | None = None     # the cut the policy chose for this layout
        self._awaiting: Bounds | None = None     # a re-cut asked for, not yet taken
        self._cut_for: dict[int, float] = {}     # the stragglers the cut was made for -> their paces then
        self._cut_at = 0                         # the step the cut was asked for
        self._costs_fn: Callable[[], list[float]] | None = None
        self._costs: list[float] | None = None   # each block's modelled work
        self._scale: dict[int, float] = {}       # rank -> its stage's balanced work over its work now
        self._workers: dict[int, int] | None = None
        self._virtual = 1
        self._calib: tuple[dict, dict] | None = None   # (compute before a re-cut, since) per rank
        self.tracker = PaceTracker(cfg.threshold, cfg.window)
        self._priced = EqualShare()
        self.shares: list[int] | None = None   # micro-batches per replica; None: equal
        self._for: set[int] = set()            # the stragglers the shares were made for
        self._topo = None
        self._equal = 1
        self._row_fn: Callable[[], dict | None] | None = None
        self._row: dict | None = None
        self._worker_s: collections.deque = collections.deque(maxlen=cfg.window)
        # Steps with no straggler: each enters a window late, once no slowdown it was part of
        # can still be named (one is named within the window of its onset).
        self._healthy: collections.deque = collections.deque(maxlen=cfg.window)
        self._unproven: collections.deque = collections.deque()
        self._actual: dict[int, collections.deque] = {}   # rank -> compute seconds as run, over the window
        self._decided_at = 0

    def new_plan(self, topo, equal_micro_batches: int = 1, row_fn: Callable[[], dict | None] | None = None,
                 bounds=None, workers: dict[int, int] | None = None,
                 costs_fn: Callable[[], list[float]] | None = None, virtual: int = 1) -> None:
        """A new plan: shares start equal. ``row_fn`` gives the planner's row of the plan, and
        ``costs_fn`` each block's modelled work (each asked for once, when a straggler first
        needs pricing); ``bounds``: its stage cut; ``workers``: rank -> worker id. Paces start
        again, except where the same workers run the same layout, cut as it was or as asked
        (``Moves.cut``): then each rank keeps its pace, read at the balanced cut."""
        bounds = tuple(tuple(b) for b in bounds) if bounds is not None else None
        same = (self._topo is not None and (topo.dp, topo.pp) == (self._topo.dp, self._topo.pp)
                and workers is not None and workers == self._workers and bounds is not None
                and bounds in (self._bounds, self._awaiting))
        self._topo, self._equal, self._row_fn, self._row = topo, equal_micro_batches, row_fn, None
        self._workers, self._virtual = dict(workers) if workers is not None else None, virtual
        before, self._bounds, self._awaiting = self._bounds, bounds, None
        self._calib = None
        if same and bounds == before:
            pass   # a retry in place: the scales (calibrated ones too) stand
        elif same:
            self._priced.reset()   # stages hold other blocks: their ends weigh otherwise
            self._scale = self._scales()
            if self._scale:
                # The modelled work of a block can be off (a head's softmax, an embedding), and
                # the slowdown is the same a moment later: the first steps on the new cut set
                # each rank's scale so that it reads the compute it had just before.
                self._calib = ({r: self.tracker.compute_median(r) for r in range(topo.world_size)}, {})
        else:
            self.tracker.reset({r: topo.coords(r)[1] for r in range(topo.world_size)})
            self._priced.reset()
            self._balanced, self._cut_for, self._scale = bounds, {}, {}
            self._costs_fn, self._costs = costs_fn, None
            self._healthy.clear()
            self._unproven.clear()
            self._actual = {r: collections.deque(maxlen=self.cfg.window) for r in range(topo.world_size)}
        self.shares, self._for = None, set()
        self._bench_pending = None
        self._worker_s.clear()
        self._decided_at = 0

    def _scales(self) -> dict[int, float]:
        """Rank -> its stage's work at the balanced cut over its work now (1 on the balanced cut)."""
        if self._bounds == self._balanced or self._bounds is None or self._balanced is None:
            return {}
        costs = self._block_costs()
        was, now = stage_work(costs, self._balanced), stage_work(costs, self._bounds)
        return {r: was[self._topo.coords(r)[1]] / now[self._topo.coords(r)[1]]
                for r in range(self._topo.world_size) if now[self._topo.coords(r)[1]] > 0}

    def observe(self, step: int, results: dict, record: dict, where: dict[int, tuple],
                shares: list[int] | None | str = "current") -> list[dict]:
        """Add the pace of ``step`` to ``record`` (``results``: worker id -> its step result;
        ``where``: rank -> (worker id, node)); returns the straggler events to record.
        ``shares``: those the step ran with, where they may differ from ``self.shares`` (a lease
        issued before the steps that moved them were seen)."""
        if not self.on:
            return []
        ran = self.shares if shares == "current" else shares
        own = {o["rank"]: o.get("forward_s", 0.0) + o.get("backward_s", 0.0) + o.get("optimizer_s", 0.0)
               for o in results.values()}
        record["rank_compute_s"] = {str(r): round(c, 6) for r, c in sorted(own.items())}
        for r, c in own.items():
            self._actual.setdefault(r, collections.deque(maxlen=self.cfg.window)).append(c)
        priced = self._priced.compute(list(results.values()), {r: self._topo.coords(r)[1] for r in own}
                                      if self._topo is not None else {}, self._equal)
        compute = {r: c * self._scale.get(r, 1.0) for r, c in priced.items()}
        record["rank_wait_s"] = {str(o["rank"]): round(o.get("wait_s", 0.0), 6)
                                 for o in sorted(results.values(), key=lambda o: o["rank"])}
        if ran is not None:
            record["shares"] = list(ran)
        # A replica already on fewer micro-batches is worked around: its other ranks, read at
        # the equal share from fewer calls, are not named on top.
        held = ({r for i, n in enumerate(ran) if n < self._equal for r in self._replica_ranks(i)}
                if ran is not None else set())
        if self._calib is not None:
            paces, events = self._calibrate(compute), []
        else:
            paces, events = self.tracker.update(step, compute, held)
        record["pace"] = {str(r): round(p, 4) for r, p in sorted(paces.items())}
        worker_s = record.get("worker_s") or record.get("step_time_s") or 0.0
        self._worker_s.append(worker_s)
        if self.tracker.stragglers or events:
            self._unproven.clear()
        else:
            self._unproven.append(worker_s)
            if len(self._unproven) > self.cfg.window:
                self._healthy.append(self._unproven.popleft())
        for ev in events:
            wid, node = where.get(ev["rank"], (None, None))
            ev.update(worker=wid, node=node)
        return events

    def _calibrate(self, compute: dict[int, float]) -> dict[int, float]:
        """A step of the first ones on a new cut: gathered, not paced (the paces stay as they
        were); after ``_CALIBRATION_STEPS`` each rank's scale is corrected by its compute before
        the re-cut over its median since."""
        before, after = self._calib
        for r, c in compute.items():
            after.setdefault(r, []).append(c)
        if all(len(after.get(r, ())) >= _CALIBRATION_STEPS for r in before):
            for r, was in before.items():
                now = statistics.median(after[r])
                # Past what a model's error explains, the rank's speed changed meanwhile (it
                # recovered during the re-plan, or turned slow): the modelled scale stands.
                if was and now > 0 and abs(math.log(was / now)) <= math.log(_MODEL_ERROR):
                    self._scale[r] = self._scale.get(r, 1.0) * was / now
            self._calib = None
        return {r: p for r in compute if (p := self.tracker.pace_of(r)) is not None}

    @property
    def cut_pending(self) -> Bounds | None:
        """The stage cut a re-cut asked for, until the plan that takes it (``new_plan``)."""
        return self._awaiting

    def bench_refused(self) -> None:
        """The spare asked for cannot be left out (its worker is gone): no re-plan is coming for it."""
        self._bench_pending = None

    def act(self, step: int, named: bool) -> "Moves":
        """After ``observe``: move the shares, re-cut the stages or leave the straggler out, where
        that repays (``named``: a straggler was named this step). Returns the ``rebalance``
        events, carrying the re-plan they ask the loop for (``Moves.bench``, ``Moves.cut``)."""
        self._decided = None
        events = self._act(step, named)
        bench, cut = self._decided or (None, None)
        self._decided = None
        return Moves(events, bench, cut)

    def _act(self, step: int, named: bool) -> list[dict]:
        if not self.acts or self._topo is None:
            return []
        slow = self.tracker.stragglers
        if self.shares is not None and not (self._for & slow.keys()):
            before, self.shares, self._for = self.shares, None, set()
            return [{"kind": "rebalance", "step": step, "action": "equal shares", "shares": None,
                     "shares_before": before, "reason": "the ranks it was for recovered"}]
        if self._awaiting is not None or self._bench_pending is not None:
            return []   # a re-plan is on its way
        if self._bounds != self._balanced:
            expired = step - self._cut_at >= self.cfg.payback_steps
            still = self._cut_for.keys() & slow.keys()
            gone = bool(still) and self._premise_gone()
            recovered = not still or gone
            # Another clearly slow rank takes a cut over from those that recovered (the next
            # decision re-cuts from here); one a little slow, as a busy host makes a rank for a
            # while, does not hold it.
            others = set(self._clearly_slow(slow)) - self._cut_for.keys() if recovered else set()
            if (recovered and not others) or expired:
                # Back when its ranks recovered; and after payback_steps in any case, to be
                # measured again at the balanced cut (a pace read on a re-cut may drift).
                self._awaiting = self._balanced
                self._decided = (None, self._balanced)
                return [{"kind": "rebalance", "step": step, "action": "balanced cut",
                         "stages": [list(b) for b in self._balanced], "stages_before": [list(b) for b in self._bounds],
                         "reason": "balance.payback_steps on the re-cut: measured again at the balanced cut"
                         if expired else "the ranks it was for came more than half-way back: measured again "
                         "at the balanced cut" if gone else "the ranks it was for recovered"}]
            if recovered:
                self._cut_for = self._paces_now(others)
        if not slow or not (named or step - self._decided_at >= self.cfg.window):
            return []
        if len(self._worker_s) < self.cfg.window:
            return []   # a plan just taken (a re-cut keeps the stragglers): its step is not known yet
        if not (self.shares_ok and self._topo.dp > 1) and not self._lasting(step, slow, windows=1):
            return []   # nothing to weigh yet: look again next step
        self._decided_at = step
        row = self._plan_row()
        paces = self._replica_paces()
        if row is None or paces is None or not self._worker_s:
            return []
        measured = statistics.median(self._worker_s)
        if self.shares_ok and self._topo.dp > 1:
            # Cheapest first. Taking new shares costs the replicas' next step a schedule for the
            # new count: a step, at most.
            prop = propose_shares(row, paces, self.shares, measured, self.cfg.payback_steps, cost_s=measured)
            if prop is not None and self._moves_off_the_slowest(prop.shares):
                before, self.shares = self.shares, prop.shares
                self._for = set(slow) if prop.shares is not None else set()
                return [{"kind": "rebalance", "step": step, "action": "shares" if prop.shares else "equal shares",
                         "shares_before": before, "ranks": sorted(slow),
                         "replica_pace": [round(p, 3) for p in paces], **prop.figures()}]
        return self._propose_recut(step, row, measured, slow) or self._propose_spare(step, row, paces, measured, slow)

    def _premise_gone(self) -> bool:
        """Whether every rank the standing cut was made for has come more than half-way back
        from the pace it was cut for (a 3.7x rank now 1.3x): the cut is priced for paces that no
        longer hold, and a pace read on a re-cut is the least sure (a stage of one block is timed
        in milliseconds), so the balanced cut comes back and they are measured again there."""
        for r, then in self._cut_for.items():
            now = self.tracker.pace_of(r)
            if now is None or then is None or now - 1 > (then - 1) / 2:
                return False
        return bool(self._cut_for)

    def _paces_now(self, ranks) -> dict[int, float | None]:
        return {r: self.tracker.pace_of(r) for r in ranks}

    def _clearly_slow(self, slow: dict[int, int]) -> list[int]:
        """The stragglers at a pace past ``1 + 2 * threshold``. On a host whose cores the workers
        share a rank can read 1.2x slow for a while, and 1.4x for a window."""
        return sorted(r for r in slow if (self.tracker.pace_of(r) or 0.0) > 1 + 2 * self.cfg.threshold)

    def _lasting(self, step: int, slow: dict[int, int], windows: int = 2) -> list[int]:
        """The stragglers worth a re-plan: clearly slow (``_clearly_slow``), since ``windows``
        windows at least. A re-plan costs seconds."""
        return [r for r in self._clearly_slow(slow) if step - slow[r] >= windows * self.cfg.window]

    def _propose_recut(self, step: int, row: dict, measured: float, slow: dict[int, int]) -> list[dict]:
        """Give a lasting straggler's stage fewer blocks, if that repays two re-plans (there and
        back). Each stage's pace is its slowest replica's compute, read at the balanced cut,
        over the stage's modelled work there (``planning.recut``). Lasting here means one window
        past its naming, not two as for a spare: every worker stays, and the cut comes back at
        the cost of one more re-plan (in the benchmark the second window cost a re-cut 10 of
        the slowdown's 50 steps)."""
        topo = self._topo
        # Not on top of unequal shares: the measured step has their gain in it, and a re-plan
        # starts on equal shares again.
        if (topo.pp < 2 or self._virtual != 1 or self._replan_cost_s is None or self._bounds is None
                or self.shares is not None):
            return []
        lasting = self._lasting(step, slow, windows=1)
        if not lasting:
            return []
        costs = self._block_costs()
        if costs is None:
            return []
        work = stage_work(costs, self._balanced)
        per_stage = []
        for s in range(topo.pp):
            medians = [self.tracker.compute_median(topo.rank(i, s)) for i in range(topo.dp)]
            if any(m is None for m in medians) or work[s] <= 0:
                return []
            per_stage.append(max(medians) / work[s])
        cost = 2 * (self._replan_cost_s() + 2 * measured)
        share = row["compute_s"] / row["total_s"] if row.get("total_s") else 1.0
        # Paces are window medians, good to a few percent: a re-cut (a re-plan each) must save
        # half the threshold at least, or a noisy stage pace would move blocks to and fro.
        prop = propose_recut(costs, self._bounds, per_stage, share, measured, self.cfg.payback_steps, cost,
                             min_gain=self.cfg.threshold / 2)
        if prop is None or (self._cut_fits is not None and not self._cut_fits(tuple(prop.bounds))):
            return []
        self._awaiting = tuple(tuple(b) for b in prop.bounds)
        self._decided = (None, self._awaiting)
        # For the lasting stragglers: a rank a little slow besides neither shows in the event
        # nor keeps the cut once they recover.
        self._cut_for, self._cut_at = self._paces_now(lasting), step
        fastest = min(per_stage)
        return [{"kind": "rebalance", "step": step, "action": "recut", "ranks": lasting,
                 "stages_before": [list(b) for b in self._bounds],
                 "stage_pace": [round(p / fastest, 3) for p in per_stage], **prop.figures()}]

    def _block_costs(self) -> list[float] | None:
        if self._costs is None and self._costs_fn is not None:
            self._costs, self._costs_fn = self._costs_fn(), None
        return self._costs

    def _propose_spare(self, step: int, row: dict, paces: list[float], measured: float,
                       slow: dict[int, int]) -> list[dict]:
        """Leave out the slowest lasting straggler (``_lasting``), if that repays."""
        if self._spare_plan is None or self._replan_cost_s is None:
            return []
        lasting = self._lasting(step, slow)
        if not lasting:
            return []
        choice = self._spare_plan()
        if choice is None:
            return []
        if self._healthy:
            # The planner's ratio of the two layouts at full pace, scaled by this plan's step
            # as measured before the straggler: paces read on unequal shares do not enter it.
            after = statistics.median(self._healthy) * choice.est_step_s / row["total_s"]
        else:
            predicted_now = predict_step_s(row, paces, self.shares)
            after = measured / predicted_now * choice.est_step_s if predicted_now > 0 else choice.est_step_s
        # Out now and back once it recovers: two re-plans, each a set-up, its snapshot step and a warm-up step.
        cost = 2 * (self._replan_cost_s() + 2 * measured)
        gain = measured - after
        if gain <= 0 or gain * self.cfg.payback_steps <= cost:
            return []
        rank = max(lasting, key=lambda r: self.tracker.compute_median(r) or 0.0)
        pace = self.tracker.pace_of(rank) or 1.0
        self._bench_pending = (rank, pace)
        self._decided = ((rank, pace), None)
        return [{"kind": "rebalance", "step": step, "action": "spare", "rank": rank, "pace": round(pace, 3),
                 "plan_after": {"dp": choice.dp, "pp": choice.pp}, "predicted_step_s": round(after, 6),
                 "step_s_before": round(measured, 6), "cost_s": round(cost, 6),
                 "payback_steps": round(cost / gain, 2)}]

    def _moves_off_the_slowest(self, shares: list[int] | None) -> bool:
        """Whether every replica that would give micro-batches away takes at least as long, as
        run now, as every one that would take them: a guard against the pace read at the equal
        share overstating a replica on few micro-batches (on an oversubscribed host it does),
        which would otherwise move ever more off a replica that is no longer the slowest."""
        now = self.shares or [self._equal] * self._topo.dp
        new = shares or [self._equal] * self._topo.dp
        actual = self._per_replica(lambda r: statistics.median(self._actual[r]) if self._actual.get(r) else 0.0)
        givers = [actual[i] for i in range(len(now)) if new[i] < now[i]]
        takers = [actual[i] for i in range(len(now)) if new[i] > now[i]]
        return not givers or not takers or min(givers) >= max(takers)

    def _plan_row(self) -> dict | None:
        if self._row is None and self._row_fn is not None:
            self._row, self._row_fn = self._row_fn(), None
        return self._row

    def _replica_ranks(self, replica: int) -> list[int]:
        return [self._topo.rank(replica, s) for s in range(self._topo.pp)]

    def _replica_paces(self) -> list[float] | None:
        """Each replica's compute per equal share (its slowest rank's window median) over the
        fastest replica's."""
        costs = self._per_replica(self.tracker.compute_median)
        if costs is None:
            return None
        fastest = min(costs)
        return [c / fastest for c in costs] if fastest > 0 else None

    def _per_replica(self, value: Callable[[int], float | None]) -> list[float] | None:
        """Each replica's slowest rank by ``value`` (a replica runs at its slowest stage's pace);
        None where some rank has no value yet."""
        out = []
        for i in range(self._topo.dp):
            per = [value(r) for r in self._replica_ranks(i)]
            if any(v is None for v in per):
                return None
            out.append(max(per))
        return out
