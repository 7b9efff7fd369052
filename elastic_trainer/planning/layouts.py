"""Which ``dp x pp`` layouts, with which stage cut, a run could take on the workers there are.

Feasible means: the global batch divides into ``dp`` replicas of whole
micro-batches (so it stays the same whatever the layout), the model has a
block for every pipeline stage, and the schedule can run the micro-batches
(interleaving needs ``pp >= 2`` and a whole number of rounds). Whether a
layout fits the workers' memory, and how fast it runs, is the planner's
question.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import TrainerConfig
from ..errors import ConfigError
from ..parallel.partition import blocks_for_rank, partition_blocks, stage_indices_for_rank


class NothingFits(ConfigError):
    """No layout is feasible on these workers (or fits their memory); the message says what was given."""


@dataclass(frozen=True)
class Layout:
    """``dp`` replicas of a ``pp``-rank pipeline, cut into ``stage_bounds`` (``[start, end)`` blocks per stage)."""

    dp: int
    pp: int
    stage_bounds: tuple[tuple[int, int], ...]
    micro_batches: int  # per replica and step
    stages_per_rank: int = 1  # virtual stages of the interleaved schedule

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    def stages_of(self, pp_rank: int) -> list[int]:
        """Pipeline stages PP rank ``pp_rank`` holds."""
        return stage_indices_for_rank(pp_rank, self.pp, self.stages_per_rank)

    def blocks_of(self, pp_rank: int) -> list[int]:
        """Blocks PP rank ``pp_rank`` holds, over all its stages."""
        return blocks_for_rank(self.stage_bounds, pp_rank, self.pp, self.stages_per_rank)


@dataclass(frozen=True)
class Rejection:
    """A ``dp x pp`` a run could not take, and why.

    ``dp`` or ``pp`` is None where the reason holds for every value of it
    (the global batch does not split into ``dp`` replicas whatever ``pp``).
    ``kind``: ``batch`` (the global batch does not split), ``blocks`` (more
    stages than the model has blocks), ``schedule`` (the pipeline schedule
    cannot run the micro-batches), ``memory`` (over the workers' memory:
    ``need_bytes`` on the rank that needs the most, ``over_bytes`` past the
    bound) or ``workers`` (none to run on). ``rule``: the rule broken, the
    same words for every layout that broke it; ``detail``: this layout's values.
    """

    dp: int | None
    pp: int | None
    kind: str
    rule: str
    detail: str = ""
    need_bytes: int | None = None
    over_bytes: int | None = None

    @property
    def label(self) -> str:
        """``dp=2 pp=3``, leaving out what the reason does not depend on."""
        return " ".join(f"{k}={v}" for k, v in (("dp", self.dp), ("pp", self.pp)) if v is not None)

    def __str__(self) -> str:
        return f"{self.label}: {self.rule}" + (f" ({self.detail})" if self.detail else "")


def layout_problem(cfg: TrainerConfig, n_blocks: int, dp: int, pp: int) -> Rejection | None:
    """Why ``dp x pp`` is not feasible for ``cfg`` on a model of ``n_blocks`` blocks; None when it is."""
    t, p = cfg.train, cfg.parallel
    virtual = p.stages_per_rank
    if pp * virtual > n_blocks:
        return Rejection(dp, pp, "blocks", f"the model has {n_blocks} blocks, fewer than pp x "
                                           f"stages_per_rank({virtual})")
    if p.schedule == "interleaved" and pp < 2:
        return Rejection(dp, pp, "schedule", "'interleaved' needs pp >= 2")
    if t.global_batch_size % (dp * t.micro_batch_size):
        return Rejection(dp, pp, "batch", f"global_batch_size({t.global_batch_size}) is not a multiple of dp x "
                                          f"micro_batch_size({t.micro_batch_size})")
    m = t.global_batch_size // (dp * t.micro_batch_size)
    # torch's 1F1B needs a micro-batch in flight per stage.
    if p.schedule == "1f1b" and pp > 1 and m < pp:
        return Rejection(dp, pp, "schedule", "'1f1b' needs at least pp micro-batches per replica",
                         f"{m} a replica")
    # torch's interleaved schedule runs max(1, m // pp) rounds of equal size.
    if p.schedule == "interleaved" and m % max(1, m // pp):
        return Rejection(dp, pp, "schedule", "'interleaved' needs the m micro-batches per replica in "
                                             "max(1, m // pp) equal rounds", f"m={m}")
    return None


def feasible_layouts(cfg: TrainerConfig, param_counts: list[int], n_workers: int) -> list[Layout]:
    """Every feasible ``dp x pp`` on at most ``n_workers`` workers, by ``pp`` then ``dp``.

    The stage cut balances parameters (:func:`parallel.partition.partition_blocks`),
    the same cut for every ``dp`` of one ``pp``.
    """
    t, virtual = cfg.train, cfg.parallel.stages_per_rank
    out = []
    for pp in range(1, n_workers + 1):
        if pp * virtual > len(param_counts):
            break
        bounds = None
        for dp in range(1, n_workers // pp + 1):
            if layout_problem(cfg, len(param_counts), dp, pp) is None:
                bounds = bounds or tuple(partition_blocks(param_counts, pp * virtual))
                out.append(Layout(dp, pp, bounds, t.global_batch_size // (dp * t.micro_batch_size), virtual))
    return out


def layouts_of_any_size(cfg: TrainerConfig, param_counts: list[int]) -> list[Layout]:
    """Every feasible ``dp x pp`` whatever the number of workers, by ``pp`` then ``dp``: what a run
    could take given workers enough (``dp`` divides the global batch's micro-batches, so few are tried)."""
    t, virtual = cfg.train, cfg.parallel.stages_per_rank
    replicas = t.global_batch_size // t.micro_batch_size
    out = []
    for pp in range(1, len(param_counts) // virtual + 1):
        bounds = tuple(partition_blocks(param_counts, pp * virtual))
        for dp in range(1, replicas + 1):
            if replicas % dp == 0 and layout_problem(cfg, len(param_counts), dp, pp) is None:
                out.append(Layout(dp, pp, bounds, replicas // dp, virtual))
    return out


def rejected_layouts(cfg: TrainerConfig, n_blocks: int, n_workers: int) -> list[Rejection]:
    """The ``dp x pp`` on at most ``n_workers`` workers that :func:`feasible_layouts` leaves out, and why.

    A reason that holds for every ``pp`` (the batch) or every ``dp`` (too
    few blocks, ``interleaved`` on one stage) comes once, with the other
    left None; too few blocks comes once, at the smallest such ``pp``.
    """
    out: list[Rejection] = []
    seen: set[tuple] = set()
    for pp in range(1, n_workers + 1):
        for dp in range(1, n_workers // pp + 1):
            why = layout_problem(cfg, n_blocks, dp, pp)
            if why is None:
                continue
            if why.kind == "blocks":   # and so every larger pp
                out.append(replace(why, dp=None))
                return out
            if why.kind == "batch":
                why = replace(why, pp=None)
            elif pp < 2:   # 'interleaved' on one stage, whatever dp
                why = replace(why, dp=None)
            if (why.dp, why.pp, why.kind) not in seen:
                seen.add((why.dp, why.pp, why.kind))
                out.append(why)
    return out


_KINDS = ("workers", "memory", "batch", "schedule", "blocks")


def describe_rejections(rejected: list[Rejection], most: int = 6) -> str:
    """``rejected`` as one line: those over memory each with its figures, the others by the rule
    they broke; at most ``most`` layouts a line."""
    out = []
    for kind in _KINDS:
        rs = [r for r in rejected if r.kind == kind]
        if kind == "memory" and rs:
            out.append(listed([f"{r.label} {r.detail}" for r in rs], most))
        elif kind == "workers":
            out += [f"{r.rule} ({r.detail})" for r in rs]
        else:
            for rule in dict.fromkeys(r.rule for r in rs):
                labels = [r.label + (f" ({r.detail})" if r.detail else "") for r in rs if r.rule == rule]
                out.append(f"{listed(labels, most)}: {rule}")
    return "; ".join(out)


def listed(items: list[str], most: int = 8) -> str:
    """``items`` joined by commas, past ``most`` of them counted rather than named."""
    return ", ".join(items[:most]) + (f" (and {len(items) - most} more)" if len(items) > most else "")


def no_layout_message(cfg: TrainerConfig, n_workers: int, n_blocks: int) -> str:
    """Why :func:`feasible_layouts` found nothing: each ``dp x pp`` it left out and the rule it broke."""
    return f"no dp x pp fits {n_workers} worker(s): " + describe_rejections(rejected_layouts(cfg, n_blocks, n_workers))
