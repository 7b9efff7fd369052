"""The campaign's checker: what a run under faults left, held to the invariants of a run that
loses nothing.

- it ended FINISHED, or FAILED with a named cause where the schedule left too little (more
  lethal faults than ``failure.max_failures``); it never hung;
- every step of its history appears once, in order, each reading the batch after the last;
- its final weights and optimizer state equal the failure-free run's: bit for bit where every
  step of its history ran under the failure-free run's layout (the same reductions in the same
  order), else within ``4 * lr`` per step run under another layout (AdamW moves an element by
  at most a few ``lr`` a step, whatever its gradient: an element whose gradient is at rounding
  level can take that step either way once the reduction order changes);
- every durable checkpoint of the run left in storage verifies, holds every block and every
  slice of a sharded optimizer (``checkpoint.cover``), loads whole, and is read by the ranks of
  other layouts through the workers' own read (``check_resumes``); the final one holds exactly
  the run's final weights;
- no restore read a local copy of a timeline the run had abandoned (``worker.copies.on_timeline``);
- the failures counted match the faults struck: none without a lethal fault, at least one
  failure or fence for each lethal fault struck at a worker;
- a drain with room to move (``drain``) costs no failure and redoes nothing: the run leaves
  the node before its deadline (``check_drains``);
- nothing of the run outlived it: actors, worker processes;
- its goodput adds up: every bucket at least 0, together the run's wall time as its own state
  events time it (within 1%), and steps rolled back show as time redone (``check_goodput``).

Each check is a function of plain values (history, events, states, manifests), so the tests
plant violations in them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...checkpoint.cover import cover_problems
from ...data.skips import cursor
from ...worker.copies import on_timeline
from .schedule import KILLS, LETHAL

# The layouts every checkpoint is read at, beside the one it was written at: (pp, dp) with the
# optimizer state sharded dp ways. One rank holding everything; three stages of three ranks,
# whose slices cut across the writers' (a resume on another cluster size).
RESUME_LAYOUTS = ((1, 1), (3, 3))

# What AdamW can move an element by in one step, in units of lr: |m_hat| / (sqrt(v_hat) + eps)
# stays within (1 - beta1) / sqrt(1 - beta2) of 1 for default betas (about 3.2), rounded up.
ADAMW_STEP_LR = 4.0


@dataclass(frozen=True)
class Violation:
    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"


def check_end(state: str, error: str | None, lethal: int, max_failures: int) -> list[Violation]:
    if state in ("FINISHED", "STOPPED"):
        return []
    if state == "FAILED" and error and "max_failures" in error and lethal > max_failures:
        return []   # the schedule left too little, and the run said so
    return [Violation("ended", f"{state}" + (f" ({error[:300]})" if error else "")
                      + f" after {lethal} lethal fault(s), max_failures {max_failures}")]


def check_history(history: list[dict], steps: int, global_batch: int, skips=()) -> list[Violation]:
    got = [r["step"] for r in history]
    out = []
    if got != list(range(1, steps + 1)):
        seen: dict[int, int] = {}
        for s in got:
            seen[s] = seen.get(s, 0) + 1
        twice = sorted(s for s, n in seen.items() if n > 1)
        missing = sorted(set(range(1, steps + 1)) - set(got))
        out.append(Violation("steps_once", f"history steps {_runs(got)}"
                             + (f"; twice: {twice[:10]}" if twice else "") + (f"; missing: {missing[:10]}" if missing else "")
                             + ("" if twice or missing else "; out of order")))
    # ``skips``: the sample ranges the run left out (the config's, its anomalies'): the batches after
    # one move past it.
    bad = [(r["step"], r.get("cursor")) for r in history if r.get("cursor") != cursor(r["step"], global_batch, skips)]
    if bad:
        out.append(Violation("data_cursor", f"steps whose batch is not the one after the last (step, cursor): {bad[:5]}"))
    return out


def layout_of(plan: dict | None) -> tuple | None:
    """What decides a step's reductions and their order: dp, pp, the stage cut, the sharding."""
    if not plan:
        return None
    return (plan.get("dp"), plan.get("pp"), tuple(tuple(s["blocks"]) for s in plan.get("stages", ())),
            plan.get("shard_optimizer"))


def steps_off_layout(history: list[dict], plans: list[dict], reference: tuple) -> int:
    """How many steps of ``history`` ran under a layout other than ``reference``."""
    return sum(1 for r in history if layout_of(plans[r["plan"]] if r.get("plan") is not None and r["plan"] < len(plans)
                                               else None) != reference)


def check_state(got: dict | None, want: dict, off_layout: int, lr: float, what: str = "final state") -> list[Violation]:
    """``got`` against ``want`` (name -> tensor or array): equal bit for bit where ``off_layout`` is 0,
    else within ``ADAMW_STEP_LR * lr`` per step run off it."""
    if got is None:
        return [Violation(what, "the run returned none")]
    if set(got) != set(want):
        return [Violation(what, f"names differ: {sorted(set(got) ^ set(want))[:5]}")]
    bound = ADAMW_STEP_LR * lr * off_layout
    worst, where = 0.0, None
    for name in sorted(want):
        a, b = _np(got[name]), _np(want[name])
        if a.shape != b.shape:
            return [Violation(what, f"{name}: shape {a.shape} != {b.shape}")]
        if off_layout == 0:
            if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
                n = int(np.sum(a != b))
                return [Violation(what, f"{name}: {n} element(s) differ where bit-identity is due (every step "
                                        f"ran under the failure-free layout), up to {float(np.max(np.abs(a - b))):.3g}")]
            continue
        d = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0
        if d > worst:
            worst, where = d, name
    if worst > bound:
        return [Violation(what, f"{where} is {worst:.3g} off the failure-free run's, over the bound {bound:.3g} "
                                f"({ADAMW_STEP_LR:g} lr x {off_layout} step(s) under another layout)")]
    return []


def check_checkpoint(name: str, manifest: dict, parts: list[dict], n_blocks: int,
                     final_state: dict | None = None) -> list[Violation]:
    """One durable checkpoint: verified parts (the caller read them, checksums and all), every
    block and slice held, the whole model assembled from them; ``final_state``: the run's last
    weights, which the final checkpoint holds exactly."""
    from ...checkpoint.state import merge_shards

    problems = cover_problems(manifest.get("files", []), n_blocks)
    if problems:
        return [Violation("checkpoint_cover", f"{name}: " + "; ".join(problems))]
    names = sorted({n for p in parts for n in p["params"]})
    try:
        step, params, optim = merge_shards(parts, names)
    except ValueError as e:
        return [Violation("checkpoint_loads", f"{name}: {e}")]
    if step != manifest.get("step"):
        return [Violation("checkpoint_loads", f"{name}: parts of step {step}, manifest of {manifest.get('step')}")]
    bad = check_resumes(name, parts, n_blocks, params, optim)
    if bad:
        return bad
    if final_state is not None:
        diff = [n for n in names if n in final_state and not np.array_equal(_np(params[n]), _np(final_state[n]))]
        if diff or set(names) != set(final_state):
            return [Violation("final_checkpoint", f"{name}: does not hold the run's final weights ("
                                                  + (f"{diff[:3]} differ" if diff else "other names") + ")")]
    return []


def check_resumes(name: str, parts: list[dict], n_blocks: int, params: dict, optim: dict,
                  layouts=RESUME_LAYOUTS) -> list[Violation]:
    """``name`` read as a resume at each of ``layouts`` reads it: each rank takes its stage's
    blocks (``pp`` contiguous cuts) and its ``dp``-th of each parameter's moments, through the
    read a worker makes (``merge_shards`` with the ranges it owns); every rank's read succeeds
    and gives back its range of the whole (``params``, ``optim``: the checkpoint read whole)."""
    from ...checkpoint.state import block_of, merge_shards

    for pp, dp in layouts:
        for stage, blocks in enumerate(np.array_split(np.arange(n_blocks), pp)):
            held = set(blocks.tolist())
            mine = sorted(n for n in params if block_of(n) in held)
            for r in range(dp):
                owned = {n: (_np(params[n]).size * r // dp, _np(params[n]).size * (r + 1) // dp) for n in mine}
                where = f"{name}: read at pp={pp} x dp={dp} (sharded) as rank {stage * dp + r}"
                try:
                    _, got_params, got_optim = merge_shards(parts, mine, owned)
                except ValueError as e:
                    return [Violation("checkpoint_resumes", f"{where}: {e}")]
                for n in mine:
                    lo, hi = owned[n]
                    if not np.array_equal(_np(got_params[n]), _np(params[n])):
                        return [Violation("checkpoint_resumes", f"{where}: {n} differs from the whole read")]
                    for k, v in optim.get(n, {}).items():
                        want = _np(v)
                        if want.ndim and not np.array_equal(_np(got_optim.get(n, {}).get(k, np.empty(0))).reshape(-1),
                                                            want.reshape(-1)[lo:hi]):
                            return [Violation("checkpoint_resumes",
                                              f"{where}: {n}'s {k} over [{lo}, {hi}) differs from the whole read")]
    return []


def check_timeline(events: list[dict]) -> list[Violation]:
    """No restore read a local copy made under a set-up of a timeline the run had abandoned."""
    out = []
    for ev in events:
        if ev.get("kind") != "recovery" or not ev.get("local_generations"):
            continue
        timeline = [tuple(t) for t in ev.get("timeline") or []]
        step = ev["restored_step"]
        for rank, gens in ev["local_generations"].items():
            stale = [g for g in gens if not on_timeline(step, g, timeline)]
            if stale:
                out.append(Violation("abandoned_timeline",
                                     f"rank {rank} restored step {step} from a copy made under set-up(s) {stale}, "
                                     f"rolled back since (timeline {timeline})"))
    return out


def check_counts(struck: list[dict], events: list[dict]) -> list[Violation]:
    """Failures against the faults struck: none without a lethal fault that hit a worker; each
    kill seen (a failure, a fence, or at the final save the worker named gone at the end)."""
    lethal = [s for s in struck if s["kind"] in LETHAL and s.get("done") not in ("skipped", "gone")]
    kills = [s for s in lethal if s["kind"] in KILLS]
    failures = [e for e in events if e.get("kind") == "failure"]
    seen = failures + [e for e in events if e.get("kind") == "fence"
                       or (e.get("kind") == "checkpoint_problem" and "gone at the end" in str(e.get("detail")))]
    if not lethal and failures:
        return [Violation("failures_counted", f"{len(failures)} failure(s) with no lethal fault struck: "
                                              f"{[(f.get('failure'), f.get('step')) for f in failures][:5]}")]
    if kills and not seen:
        return [Violation("failures_counted", f"{len(kills)} kill(s) struck ({', '.join(k['fault'] for k in kills)}), "
                                              "no failure, fence or worker gone at the end recorded")]
    return []


def check_drains(struck: list[dict], events: list[dict]) -> list[Violation]:
    """Each node drained with room to move (``drain``): no failure on it, and no recovery that
    rolled committed steps back while it was leaving."""
    drained = {s["node"]: s for s in struck if s["kind"] == "drain" and s.get("done") == "drained"}
    out = []
    for node, s in drained.items():
        lost = [e for e in events if e.get("kind") == "failure" and e.get("node") == node]
        if lost:
            out.append(Violation("drain_moved", f"{s['fault']} with {s.get('seconds')} s of notice: the run lost its "
                                                f"worker(s) there ({lost[0].get('failure')} at step {lost[0].get('step')})"
                                                " instead of leaving the node before its deadline"))
        redone = [e for e in events if e.get("kind") == "recovery" and e.get("reason") == "drain"
                  and (e.get("steps_rolled_back") or 0) > 0]
        if redone:
            out.append(Violation("drain_moved", f"{s['fault']}: its re-plan rolled back "
                                                f"{redone[0]['steps_rolled_back']} committed step(s)"))
    return out


def check_goodput(goodput: dict | None, events: list[dict], finished: bool) -> list[Violation]:
    """The run's wall time, bucket by bucket (``controller.run.goodput``): no bucket below 0;
    together the wall time, which (for a run that returned) is the span of its state events;
    and time redone where a recovery rolled back committed steps."""
    if goodput is None:
        return [Violation("goodput", "the run returned no goodput")] if finished else []
    seconds, wall = goodput["seconds"], goodput["wall_s"]
    out = []
    below = {b: s for b, s in seconds.items() if s < 0}
    if below:
        out.append(Violation("goodput", f"buckets below 0: {below}"))
    if abs(sum(seconds.values()) - wall) > 0.01 * wall:
        out.append(Violation("goodput", f"buckets add up to {sum(seconds.values()):.3f} s, the wall time is {wall:.3f} s"))
    states = [e["time"] for e in events if e.get("kind") == "state"]
    if finished and len(states) >= 2 and abs((states[-1] - states[0]) - wall) > 0.01 * wall + 0.05:
        out.append(Violation("goodput", f"wall time {wall:.3f} s, the run's state events span "
                                        f"{states[-1] - states[0]:.3f} s"))
    rolled = sum(e.get("steps_rolled_back") or 0 for e in events if e.get("kind") == "recovery")
    if rolled and seconds.get("redone", 0.0) <= 0:
        out.append(Violation("goodput", f"{rolled} committed step(s) rolled back, no time redone"))
    return out


def check_leftovers(leftovers: list[str]) -> list[Violation]:
    return [Violation("leftovers", "; ".join(leftovers[:10]))] if leftovers else []


def _np(v) -> np.ndarray:
    if hasattr(v, "detach"):
        v = v.detach().cpu()
        if str(v.dtype) == "torch.bfloat16":
            v = v.float()
        return v.numpy()
    return np.asarray(v)


def _runs(steps: list[int]) -> str:
    """[1, 2, 3, 5, 5, 6] -> '1..3, 5, 5..6'."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in spans)
