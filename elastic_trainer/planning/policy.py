"""Which ``dp x pp`` a run takes on the workers there are: after a loss, and when nodes join.

Policies return decisions; they never touch Ray, so tests call them directly.

The decision is the planner's: the same calibrated step-time model and the
same memory model that ``elastic-trainer plan`` prints, restricted to the
run's own ``comm.compression`` and ``comm.sync`` (a recovery changes the
layout, never the codec: that would change the loss curve and drop the
error-feedback state), and to the layouts whose memory fits a worker. So
``plan --workers N`` shows, as its ``replan`` row, what a run re-plans to on
``N`` workers.

The start is held to the same memory bound (:func:`check_start`, before any
worker is placed), and where nothing fits, :func:`no_plan_reason` says why:
each layout left out, the rule it broke or how far over memory it is, and
what would fit.

It runs on the recovery path. The model's shapes and the constants file are
read once and cached, and only the configured codec's rows are priced, so a
re-plan after the first costs milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import TrainerConfig
from ..errors import ConfigError
from .constants import flops_rate, run_constants
from .layouts import (Layout, NothingFits, Rejection, describe_rejections, feasible_layouts, layouts_of_any_size,
                      listed, rejected_layouts)
from .memory import MemoryModel, RankMemory, in_flight, layout_shard, rank_memory, stage_activation_bytes
from .model_shape import model_shape
from .plan import Plan
from .planner import predict_candidates, rank_key, serves
from .recut import block_costs


@dataclass(frozen=True)
class PlanChoice:
    """A layout to run: ``dp x pp`` with its stage cut, its predicted step time and memory, and why."""

    dp: int
    pp: int
    stage_bounds: tuple[tuple[int, int], ...]
    est_step_s: float  # predicted seconds per step
    memory_bytes: int  # predicted bytes on the worker that needs the most
    reason: str

    @property
    def world_size(self) -> int:
        return self.dp * self.pp


def replan_row(rows: Sequence[dict], cfg: TrainerConfig) -> dict | None:
    """The row a run of ``cfg`` re-plans to among ``rows``: the fastest that keeps its codec and sync.

    ``rows`` are :func:`planner.predict_candidates`'s, all of them or only the
    configured ones; ties go as :func:`planner.recommend` breaks them
    (:func:`planner.rank_key`). None when no row keeps the codec and sync.
    """
    ok = [r for r in rows if serves(r, cfg.comm.compression, cfg.comm.sync)]
    return min(ok, key=rank_key) if ok else None


def layout_key(dp: int, pp: int, stage_bounds) -> tuple:
    """A layout as ``choose_plan``'s ``avoid`` names it."""
    return dp, pp, tuple(tuple(b) for b in stage_bounds)


def choose_plan(cfg: TrainerConfig, n_workers: int, worker_memory_bytes: float | None = None,
                constants: dict | None = None, avoid: frozenset | set = frozenset()) -> PlanChoice | None:
    """The fastest predicted layout on at most ``n_workers`` workers that fits ``worker_memory_bytes`` each.

    ``constants``: a constants document (:func:`constants.load_constants`);
    default: the file ``cfg.comm.constants`` names, else the built-ins. Its
    ``compute`` entry, if any, sets the compute rate, as in ``plan``. The
    global batch stays ``cfg.train.global_batch_size``; the micro-batches per
    replica follow from ``dp``. None when no layout is feasible or fits:
    :func:`no_plan_reason` then says why, :func:`rejected_plans` lists each
    layout left out. ``avoid``: layouts (``layout_key``) found not to fit at a set-up.
    """
    if n_workers == 0:
        return None
    doc = run_constants(cfg) if constants is None else constants
    try:
        # A model whose activations cannot be measured on meta is still re-planned (its pipelines
        # priced without transfers): stopping the run would be worse than a rougher choice.
        rows = predict_candidates(cfg, n_workers, doc, (doc or {}).get("compute"),
                                  worker_memory_bytes=worker_memory_bytes, only_configured=True,
                                  refuse_unmeasured=False)
    except NothingFits:
        return None
    if avoid:
        rows = [r for r in rows if layout_key(r["dp"], r["pp"], r["stage_bounds"]) not in avoid]
    best = replan_row(rows, cfg)
    if best is None:
        return None
    return PlanChoice(best["dp"], best["pp"], tuple(tuple(b) for b in best["stage_bounds"]), best["total_s"],
                      best["memory_bytes"], _reason(best, rows, worker_memory_bytes))


def plan_row(cfg: TrainerConfig, dp: int, pp: int, constants: dict | None = None) -> dict | None:
    """The planner's row for running ``cfg`` as ``dp x pp`` (its codec and sync), priced as
    :func:`choose_plan` prices it; None when that layout is not feasible."""
    doc = run_constants(cfg) if constants is None else constants
    try:
        rows = predict_candidates(cfg, dp * pp, doc, (doc or {}).get("compute"), only_configured=True,
                                  refuse_unmeasured=False)
    except NothingFits:
        return None
    ok = [r for r in rows if (r["dp"], r["pp"]) == (dp, pp) and serves(r, cfg.comm.compression, cfg.comm.sync)]
    return min(ok, key=rank_key) if ok else None


def plan_block_costs(cfg: TrainerConfig, dp: int, constants: dict | None = None) -> list[float]:
    """Each block's modelled compute seconds per step on a rank of a ``dp``-replica run of ``cfg``,
    by the terms :func:`planner.predict_candidates` prices a rank's compute with (see
    :func:`recut.block_costs`): what a stage re-cut weighs blocks by."""
    doc = run_constants(cfg) if constants is None else constants
    rate, opt_cost, _, block_cost, _ = flops_rate((doc or {}).get("compute"))
    t = cfg.train
    micro = max(1, t.global_batch_size // (dp * t.micro_batch_size))
    return block_costs(model_shape(cfg).param_counts, t.global_batch_size // dp * cfg.data.seq_len, micro, rate,
                       block_cost, opt_cost)


def cut_fits(cfg: TrainerConfig, dp: int, pp: int, stage_bounds, worker_memory_bytes: float | None) -> bool:
    """Whether ``dp x pp`` cut into ``stage_bounds`` fits ``worker_memory_bytes`` on every worker by
    the planner's memory model (always, where no bound is set)."""
    if worker_memory_bytes is None:
        return True
    return max(m.bounded for m in _rank_needs(cfg, _layout(cfg, dp, pp, stage_bounds), worker_memory_bytes)
               ) <= worker_memory_bytes


def memory_bound(cfg: TrainerConfig) -> float | None:
    """``scaling.worker_memory_gb`` in bytes, the bound plans are held to; None: no bound."""
    gb = cfg.scaling.worker_memory_gb
    return gb * (1 << 30) if gb else None


def rank_estimates(cfg: TrainerConfig, dp: int, pp: int, stage_bounds) -> list[dict]:
    """Each PP rank's bytes under ``dp x pp`` cut into ``stage_bounds``, buffer by buffer
    (:meth:`RankMemory.parts`), with ``bounded`` (what ``scaling.worker_memory_gb`` holds),
    ``micro_batches_in_flight`` and ``activation_per_micro_batch`` (for ``elastic-trainer plan``)."""
    lay = _layout(cfg, dp, pp, stage_bounds)
    shape = model_shape(cfg)
    ckpt = cfg.train.activation_checkpointing == "blocks"
    out = []
    for r, m in enumerate(_rank_needs(cfg, lay)):
        stages = lay.stages_of(r)
        per_mb = sum(stage_activation_bytes(lay, shape, st, ckpt) for st in stages)
        flight = (in_flight(cfg.parallel.schedule, lay.micro_batches, pp, r) if len(stages) == 1
                  else None)  # interleaved: chunks of several stages, see planning.memory
        out.append({"rank": r, **m.parts(), "bounded": m.bounded, "activation_per_micro_batch": per_mb,
                    "micro_batches_in_flight": flight})
    return out


def rank_store_bytes(cfg: TrainerConfig, dp: int, pp: int, stage_bounds) -> list[int]:
    """Each PP rank's snapshot bytes in object stores (:attr:`RankMemory.store`)."""
    return [m.store for m in _rank_needs(cfg, _layout(cfg, dp, pp, stage_bounds))]


def check_start(cfg: TrainerConfig, plan: Plan) -> None:
    """Raise a ``ConfigError`` where ``plan``, the layout a run starts on (``parallel.dp x pp`` and
    its stage cut), does not fit ``scaling.worker_memory_gb`` by the memory model a re-plan is held
    to (:func:`cut_fits`): before any worker is placed, rather than at the first out-of-memory.

    The message names the layout, the bytes each pipeline rank needs (state and
    activations apart), the bound, the layouts on as many workers that :func:`choose_plan`
    would accept, and the smallest ``worker_memory_gb`` that runs the layout as given.
    """
    gb = cfg.scaling.worker_memory_gb
    if gb is None:
        return
    bound = gb * (1 << 30)
    topo = plan.topology
    ranks = _rank_needs(cfg, _layout(cfg, topo.dp, topo.pp, plan.stage_bounds))
    need = max(m.bounded for m in ranks)
    if need <= bound:
        return
    n = topo.world_size
    sized = _sized(cfg, feasible_layouts(cfg, model_shape(cfg).param_counts, n))
    fits = sorted(((lay, m) for lay, m in sized if m <= bound), key=lambda s: (-s[0].world_size, s[1]))
    if fits:
        would = (f"on {n} worker(s) " + listed([f"dp={lay.dp} pp={lay.pp} ({_mib(m)})" for lay, m in fits])
                 + f" would fit (set parallel.dp and parallel.pp; `elastic-trainer plan --workers {n}` ranks them)")
    else:
        would = f"no dp x pp on {n} worker(s) fits {_mib(bound)}" + _beyond(cfg, n, bound)
    would += f"; or scaling.worker_memory_gb >= {_gb_at_least(need)} runs dp={topo.dp} pp={topo.pp} as given"
    if not fits and sized:
        lay, least = min(sized, key=lambda s: s[1])
        if least < need:
            would += f", >= {_gb_at_least(least)} dp={lay.dp} pp={lay.pp} on {lay.world_size} worker(s)"
    raise ConfigError(
        f"parallel.dp({topo.dp}) x parallel.pp({topo.pp}), stages {[list(b) for b in plan.stage_bounds]}, does "
        f"not fit scaling.worker_memory_gb({gb:g}) = {_mib(bound)} a worker by the planner's memory model "
        f"({_model_words(cfg)}): "
        + ", ".join(f"pp rank {r} needs {_mib(m.bounded)} ({_mib(m.state)} of state, snapshots and process + "
                    f"{_mib(m.activations)} activations)" for r, m in enumerate(ranks))
        + f"; {would}")


def rejected_plans(cfg: TrainerConfig, n_workers: int, worker_memory_bytes: float | None = None) -> list[Rejection]:
    """Every ``dp x pp`` on at most ``n_workers`` workers that :func:`choose_plan` could not take, and
    why: the global batch does not split, the model has too few blocks, the schedule cannot run it,
    or (over ``worker_memory_bytes``) how much it needs and by how much that is over, smallest first."""
    if n_workers < 1:
        return [Rejection(None, None, "workers", "no workers to run on", f"{n_workers} given")]
    counts = model_shape(cfg).param_counts
    out = rejected_layouts(cfg, len(counts), n_workers)
    if worker_memory_bytes is None:
        return out
    over = []
    for lay in feasible_layouts(cfg, counts, n_workers):
        ranks = _rank_needs(cfg, lay, worker_memory_bytes)
        r, top = max(enumerate(ranks), key=lambda x: x[1].bounded)
        st, act = top.state, top.activations
        if st + act > worker_memory_bytes:
            extra = st + act - worker_memory_bytes
            over.append(Rejection(lay.dp, lay.pp, "memory", f"over {_mib(worker_memory_bytes)} a worker",
                                  f"needs {_mib(st + act)}, {_mib(extra)} over: {_mib(st)} of state, snapshots "
                                  "and process + "
                                  f"{_mib(act)} activations on pp rank {r}", st + act, math.ceil(extra)))
    return out + sorted(over, key=lambda x: x.need_bytes)


def no_plan_reason(cfg: TrainerConfig, n_workers: int, worker_memory_bytes: float | None = None) -> str | None:
    """Why :func:`choose_plan` finds no plan on ``n_workers`` workers (None where it finds one):
    what was given, each layout left out and why (:func:`rejected_plans`), and what would fit:
    the fewest workers some layout fits, and the smallest ``worker_memory_gb`` on these workers."""
    counts = model_shape(cfg).param_counts
    sized = _sized(cfg, feasible_layouts(cfg, counts, n_workers), worker_memory_bytes) if n_workers >= 1 else []
    if any(worker_memory_bytes is None or m <= worker_memory_bytes for _, m in sized):
        return None
    t, p = cfg.train, cfg.parallel
    bound = ""
    if worker_memory_bytes is not None:
        gb = cfg.scaling.worker_memory_gb
        bound = f" of {_mib(worker_memory_bytes)}" + (f" (scaling.worker_memory_gb({gb:g}))"
                                                      if gb and gb * (1 << 30) == worker_memory_bytes else "")
    given = (f"no dp x pp fits {n_workers} worker(s){bound} for global_batch_size({t.global_batch_size}), "
             f"micro_batch_size({t.micro_batch_size}), schedule '{p.schedule}' and a model of {len(counts)} blocks")
    parts = [given + ": " + describe_rejections(rejected_plans(cfg, n_workers, worker_memory_bytes))]
    beyond = _beyond(cfg, n_workers, worker_memory_bytes)
    if beyond:
        parts.append(beyond.lstrip("; "))
    if sized:
        lay, least = min(sized, key=lambda s: s[1])
        parts.append(f"scaling.worker_memory_gb >= {_gb_at_least(least)} would fit dp={lay.dp} pp={lay.pp} "
                     f"on these workers")
    return "; ".join(parts)


def _layout(cfg: TrainerConfig, dp: int, pp: int, stage_bounds) -> Layout:
    t = cfg.train
    return Layout(dp, pp, tuple(tuple(b) for b in stage_bounds),
                  max(1, t.global_batch_size // (dp * t.micro_batch_size)), cfg.parallel.stages_per_rank)


def _rank_needs(cfg: TrainerConfig, lay: Layout, bound: float | None = None) -> list[RankMemory]:
    """Each PP rank's bytes, as the planner counts them, with the optimizer sharding ``lay`` runs with
    against ``bound`` (default ``scaling.worker_memory_gb``)."""
    shape = model_shape(cfg)
    shard = layout_shard(cfg, lay, shape, memory_bound(cfg) if bound is None else bound)
    return rank_memory(lay, shape, cfg.parallel.schedule, cfg.train.activation_checkpointing == "blocks",
                       MemoryModel.of(cfg, shard))


def plan_shard(cfg: TrainerConfig, plan: Plan) -> str:
    """The optimizer sharding ``plan`` runs with: the config's, or under ``auto`` the one its memory
    needs (``memory.layout_shard``, against ``scaling.worker_memory_gb``)."""
    s = cfg.parallel.shard_optimizer
    if s != "auto" or plan.topology.dp == 1:
        return s if plan.topology.dp > 1 else "none"
    lay = _layout(cfg, plan.topology.dp, plan.topology.pp, plan.stage_bounds)
    return layout_shard(cfg, lay, model_shape(cfg), memory_bound(cfg))


def _model_words(cfg: TrainerConfig) -> str:
    m = MemoryModel.of(cfg)
    buffers = "weights, gradients, moments" + (", gradient buckets" if m.buckets else "")
    if m.gpu:
        held = f"device memory: {buffers} and live activations (snapshot copies and the process are host memory)"
    else:
        held = (f"host memory: {buffers}, {m.snapshots_kept} kept snapshots and the next, live activations and "
                f"{_mib(m.runtime)} of process")
    return held + "; `elastic-trainer plan` shows each buffer"


def _sized(cfg: TrainerConfig, layouts: list[Layout], bound: float | None = None) -> list[tuple[Layout, int]]:
    return [(lay, max(m.bounded for m in _rank_needs(cfg, lay, bound))) for lay in layouts]


def _beyond(cfg: TrainerConfig, n_workers: int, bound: float | None) -> str:
    """"; dp=.. pp=.. on K worker(s) would fit": the fewest workers past ``n_workers`` a layout fits."""
    more = [(lay, m) for lay, m in _sized(cfg, layouts_of_any_size(cfg, model_shape(cfg).param_counts), bound)
            if lay.world_size > n_workers and (bound is None or m <= bound)]
    if not more:
        return "; no dp x pp fits on any number of workers" if bound is not None else ""
    lay, m = min(more, key=lambda s: (s[0].world_size, s[1]))
    return f"; dp={lay.dp} pp={lay.pp} on {lay.world_size} worker(s) would fit (needing {_mib(m)} a worker)"


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def _gb_at_least(nbytes: float) -> str:
    """``nbytes`` in GiB to three significant digits, rounded up: a ``worker_memory_gb`` that holds it."""
    gb = nbytes / (1 << 30)
    digits = max(0, 2 - math.floor(math.log10(gb)))
    text = f"{math.ceil(gb * 10 ** digits) / 10 ** digits:.{digits}f}"
    while float(text) * (1 << 30) < nbytes:   # a float's last bit
        text = f"{float(text) + 10 ** -digits:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _reason(best: dict, rows: Sequence[dict], memory: float | None) -> str:
    parts = [f"dp={best['dp']} pp={best['pp']} with {best['compression']} {best['sync']}: predicted "
             f"{best['total_s'] * 1e3:.1f} ms/step (compute {best['compute_s'] * 1e3:.1f} ms, exposed comm "
             f"{best['exposed_comm_s'] * 1e3:.1f} ms), {best['memory_bytes'] / (1 << 20):.1f} MiB per worker"
             + (f" of {memory / (1 << 20):.1f} MiB" if memory is not None else "")]
    others = sorted((r for r in rows if r is not best), key=rank_key)
    if others:
        nxt = others[0]
        parts.append(f"runner-up dp={nxt['dp']} pp={nxt['pp']} {nxt['total_s'] * 1e3:.1f} ms")
    if best["notes"]:
        parts.append(best["notes"])
    return "; ".join(parts)
