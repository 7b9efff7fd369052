"""Which ``dp x pp`` a run takes on the workers there are: after a loss, and when nodes join.

Policies return decisions; they never touch Ray, so tests call them directly.

The decision is the planner's: the same calibrated step-time model and the
same memory model that ``elastic-trainer plan`` prints, restricted to the
run's own ``comm.compression`` and ``comm.sync`` (a recovery changes the
layout, never the codec: that would change the loss curve and drop the
error-feedback state), and to the layouts whose memory fits a worker. So
``plan --workers N`` shows, as its ``replan`` row, what a run re-plans to on
``N`` workers.

It runs on the recovery path. The model's shapes and the constants file are
read once and cached, and only the configured codec's rows are priced, so a
re-plan after the first costs milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..config import TrainerConfig
from .constants import flops_rate, run_constants
from .layouts import Layout, NothingFits
from .memory import worker_memory
from .model_shape import model_shape
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


def choose_plan(cfg: TrainerConfig, n_workers: int, worker_memory_bytes: float | None = None,
                constants: dict | None = None) -> PlanChoice | None:
    """The fastest predicted layout on at most ``n_workers`` workers that fits ``worker_memory_bytes`` each.

    ``constants``: a constants document (:func:`constants.load_constants`);
    default: the file ``cfg.comm.constants`` names, else the built-ins. Its
    ``compute`` entry, if any, sets the compute rate, as in ``plan``. The
    global batch stays ``cfg.train.global_batch_size``; the micro-batches per
    replica follow from ``dp``. None when no layout is feasible or fits.
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
    t = cfg.train
    lay = Layout(dp, pp, tuple(tuple(b) for b in stage_bounds), max(1, t.global_batch_size // (dp * t.micro_batch_size)),
                 cfg.parallel.stages_per_rank)
    need, _ = worker_memory(lay, model_shape(cfg), cfg.parallel.schedule, t.activation_checkpointing == "blocks")
    return need <= worker_memory_bytes


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
