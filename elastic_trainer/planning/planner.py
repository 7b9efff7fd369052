"""Predicted step time of every layout, gradient codec and sync mode a job could run with; pick the fastest.

Pure (torch on the meta device, no Ray), so ``elastic-trainer plan``, the
re-plan after a failure (:mod:`planning.policy`) and tests call it directly.
One row per feasible ``dp x pp`` on at most ``workers`` workers (the
layouts of :func:`layouts.feasible_layouts`) times each codec under ``sync: allreduce`` plus the
``local_sgd`` and ``diloco`` modes (uncompressed, or their meetings in fp16
or bf16) and ``parameter_server`` (uncompressed, as the config requires). The heaviest rank sets the pace, so every term is
that rank's:

- compute: ``6 * params * tokens_per_replica / flops_per_s`` (forward +
  backward, the usual 2 + 4 FLOPs per parameter and token) plus
  ``micro_batches * blocks * block_overhead_s`` (what a block costs besides
  its FLOPs, which sets the pace of small models), times 4/3 with
  activation checkpointing (the recomputed forward), stretched by
  the pipeline bubble ``(m + pp - 1) / m`` (``(m + (pp - 1) / v) / m``
  interleaved), plus the optimizer step at a measured cost per parameter;
- DP gradient sync, per bucket, as :func:`sync_cost.dp_sync_cost` prices
  it, plus each codec's own arithmetic at a measured cost per element
  (scaled by the worker's measured speed against the machine it was measured on);
- overlap: with ``comm.overlap`` every bucket but the last can run during
  backward; at most :data:`OVERLAP_EFFICIENCY` of that comm is taken as
  hidden, and never more than the last micro-batch's backward;
- ``local_sgd`` / ``diloco``: one ring all-reduce of the rank's parameters
  (fp32), or of their change since the last meeting (fp16 / bf16, at its
  codec's arithmetic), every ``local_steps`` steps, charged
  ``1 / local_steps`` per step, not hidden;
- ``parameter_server``: push gradients, pull parameters; all shards sit on
  the controller's node, whose link carries every replica's gradients:
  ``cost_model.predict("ps", ..., shards=1)`` at the constants' ``ps``
  entry: measured through Ray where the constants have one (the built-ins
  do: ``benchmarks/comm.py`` times every node sending N bytes to an actor
  on the head node and back, which prices the object store's transfers),
  else the ring's; the shards run AdamW (on ``1 / ps_shards`` of the
  parameters each) instead of the workers; each row's ``notes`` say which
  constants it used;
- pipeline: each boundary moves one micro-batch's activations forward and
  their gradient back, ``micro_batch * seq_len * d_model * 4`` bytes for the
  GPT (found by a meta-device forward for any model), and each of the
  schedule's ``m + pp - 1`` slots waits for one of each:
  ``2 (m + pp - 1) (alpha + bytes * beta)``.

Each row also carries the memory one worker needs on that layout
(:func:`memory.worker_memory`: every buffer of the rank that needs the most,
for the run's own codec and sync, activations the schedule keeps alive included), and a memory bound drops the layouts over it.

``total_s = compute_s + exposed_comm_s``. Numbers are the steady state:
PowerSGD after ``powersgd_start_step``, error feedback included in the
codec cost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..comm.algorithms import bytes_sent
from ..comm.compression import CODECS
from ..config import TrainerConfig
from ..config.runtime import MEETING_CODECS, MEETING_SYNCS
from ..errors import ConfigError
from . import cost_model
from .constants import (CODEC_S_PER_ELEMENT, DEFAULT_CONSTANTS, DEFAULT_FLOPS_PER_S, OVERLAP_EFFICIENCY, alpha_beta,
                        flops_rate)
from .layouts import NothingFits, feasible_layouts, no_layout_message
from .memory import MemoryModel, layout_shard, worker_memory
from .model_shape import model_shape
from .sync_cost import ALLREDUCE_CODECS, dp_sync_cost


def pipeline_bubble(schedule: str, m: int, pp: int, virtual: int) -> float:
    """How much longer than its ``m`` micro-batches' passes a pipeline step takes (1 without one)."""
    if pp == 1:
        return 1.0
    if schedule == "interleaved":
        return (m + (pp - 1) / virtual) / m
    return (m + pp - 1) / m


def serves(row: dict, compression: str, sync: str) -> bool:
    """Whether ``row`` is how a run with ``comm.compression`` and ``comm.sync`` would go on its layout.

    A ``dp = 1`` row stands for every codec and every sync mode but the
    parameter server (nothing is averaged), so it serves them all.
    """
    if sync == "parameter_server" or row["sync"] == "parameter_server":
        return row["sync"] == sync
    if row["dp"] == 1:
        return True
    return (row["compression"], row["sync"]) == (compression, sync)


def rank_key(row: dict) -> tuple:
    """Sort key of rows: fastest first; on a tie more replicas (a live copy of every stage survives the
    next loss), then fewer workers."""
    return round(row["total_s"], 12), -row["dp"], row["world_size"]


def predict_candidates(cfg: TrainerConfig, workers: int, constants: dict | None = None,
                       compute: dict | None = None, *, worker_memory_bytes: float | None = None,
                       only_configured: bool = False, refuse_unmeasured: bool = True) -> list[dict]:
    """Predicted step time of every feasible layout x (codec | sync mode) on at most ``workers`` workers.

    ``constants``: a document from :func:`constants.load_constants` (or
    :func:`calibration.constants_document`), default
    :data:`constants.DEFAULT_CONSTANTS`.
    ``compute``: ``{"flops_per_s": r}``, or a measurement ``{"seconds": s,
    "params": n, "tokens": t}`` (one worker's forward + backward of ``n``
    parameters over ``t`` tokens took ``s``), optionally with ``"cpus": c``
    when all workers share ``c`` cores (a simulated cluster: each worker then
    runs at ``c / world_size`` of the rate), ``"optimizer_s_per_param"`` and
    ``"step_overhead_s"``: what a step costs besides forward, backward, the
    optimizer and communication (reading the batch, dispatching the step,
    Python), measured by a run that does not communicate; default 0.
    ``worker_memory_bytes``: keep only layouts whose ``memory_bytes`` fit.
    ``only_configured``: only the rows of the config's own codec and sync
    (those :func:`serves` accepts), which is all a re-plan may choose from.
    ``refuse_unmeasured``: a model whose forward does not run on the meta
    device has unknown activations; pipelines of it are refused (a
    ``ConfigError``) unless this is False, when their transfers and
    activation memory count 0 and ``notes`` say so.

    Rows are sorted by :func:`rank_key`; each has ``dp, pp, world_size,
    micro_batches, stage_bounds, compression, sync, algorithm, compute_s,
    bubble, dp_comm_s, codec_s, hidden_s, act_s, exposed_comm_s, total_s,
    comm_bytes`` (what the heaviest rank sends per step for DP sync),
    ``rank_params``, ``memory_bytes`` and ``activation_bytes`` (of the rank
    that needs the most, see :mod:`planning.memory`), ``configured`` (the
    job's own layout, codec and sync) and ``notes``. Raises
    :class:`layouts.NothingFits` when no layout is feasible or fits.
    """
    if not isinstance(cfg, TrainerConfig):
        raise ConfigError(f"predict_candidates needs a TrainerConfig; got {type(cfg).__name__}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be an int >= 1; got {workers!r}")
    if worker_memory_bytes is not None and not worker_memory_bytes > 0:
        raise ConfigError(f"worker_memory_bytes must be > 0 or None; got {worker_memory_bytes!r}")
    doc = DEFAULT_CONSTANTS if constants is None else constants
    source = doc.get("source") or (f"built-in ({DEFAULT_CONSTANTS['command']}, {DEFAULT_CONSTANTS['measured_at']})"
                                   if constants is None else "passed in")
    ab = alpha_beta(doc, source)
    ps_entry = (doc.get("algorithms") or {}).get("ps") or {}
    ps_how = ps_entry.get("derived_from", "measured") if ps_entry else "ring"
    rate, opt_cost, cpus, block_cost, rate_source = flops_rate(compute)
    overhead = float((compute or {}).get("step_overhead_s", 0.0))
    if not (math.isfinite(overhead) and overhead >= 0):
        raise ConfigError(f"compute step_overhead_s must be a finite number >= 0; got {overhead}")
    backend = cfg.scaling.resolved_backend()
    overlap = OVERLAP_EFFICIENCY.get(backend, 0.5) if cfg.comm.overlap else 0.0

    shape = model_shape(cfg)
    counts = shape.param_counts
    total_params = sum(counts)
    layouts = feasible_layouts(cfg, counts, workers)
    if not layouts:
        raise NothingFits(no_layout_message(cfg, workers, len(counts)))
    checkpointing = cfg.train.activation_checkpointing == "blocks"
    model = MemoryModel.of(cfg)
    # Each layout with the optimizer sharding it would run with (``auto``: where it must, to fit).
    shards = {lay: layout_shard(cfg, lay, shape, worker_memory_bytes) for lay in layouts}
    sized = [(lay, *worker_memory(lay, shape, cfg.parallel.schedule, checkpointing, MemoryModel.of(cfg, shards[lay])))
             for lay in layouts]
    unsharded = {lay: worker_memory(lay, shape, cfg.parallel.schedule, checkpointing, MemoryModel.of(cfg, "none"))[0]
                 for lay in layouts if shards[lay] != "none"}
    if worker_memory_bytes is not None:
        fitting = [s for s in sized if s[1] <= worker_memory_bytes]
        if not fitting:
            lay, need, act = min(sized, key=lambda s: s[1])
            proc = 0 if model.gpu else model.runtime
            raise NothingFits(
                f"no dp x pp on {workers} worker(s) fits {_mib(worker_memory_bytes)} per worker; the smallest, "
                f"dp={lay.dp} pp={lay.pp}, needs {_mib(need)} ({_mib(need - act - proc)} of state and snapshots, "
                f"{_mib(act)} of activations, {_mib(proc)} the process itself): give workers more memory or the "
                "run more workers")
        sized = fitting
    t, par, c = cfg.train, cfg.parallel, cfg.comm
    virtual = par.stages_per_rank
    shape_notes = [n for n in (
        f"activations unknown ({shape.why}): transfers and activation memory count 0" if shape.why else "",
        shape.note) if n]

    def wanted(dp: int, compression: str, sync: str) -> bool:
        return not only_configured or serves({"dp": dp, "compression": compression, "sync": sync},
                                             c.compression, c.sync)

    rows = []
    for lay, memory, act_mem in sized:
        dp, pp, m = lay.dp, lay.pp, lay.micro_batches
        if pp > 1 and shape.why and refuse_unmeasured:
            raise ConfigError(f"cannot size the activations between pipeline stages: the model does not run "
                              f"on the meta device ({shape.why}); plan with --workers 1, or make the model's "
                              "forward work on meta tensors")
        # The heaviest rank (with interleaving a rank holds `virtual` stages).
        ranks = []
        for r in range(pp):
            shapes = [s for blk in lay.blocks_of(r) for s in shape.param_shapes[blk]]
            ranks.append((sum(math.prod(s) for s in shapes), shapes))
        rank_params, shapes = max(ranks, key=lambda x: x[0])
        per_worker = rate * (min(1.0, cpus / (dp * pp)) if cpus else 1.0)
        tokens = t.global_batch_size // dp * cfg.data.seq_len
        slowdown = rate / per_worker
        # The codecs' per-element costs were measured on one thread of the development machine,
        # whose rate is the built-in one: a measured rate says how much slower (or faster) this
        # worker is. Unscaled, the lab's hosts of 0.375 of a core had int8 and top-k 19-29% fast.
        host = DEFAULT_FLOPS_PER_S / rate
        rank_blocks = max(len(lay.blocks_of(r)) for r in range(pp))
        fwd_bwd = 6 * rank_params * tokens / per_worker + m * rank_blocks * block_cost * slowdown
        if checkpointing:
            fwd_bwd *= 4 / 3  # backward recomputes each block's forward: 2 more FLOPs of every 6
        bubble = pipeline_bubble(par.schedule, m, pp, virtual)
        optimizer = rank_params * opt_cost * slowdown
        compute_s = fwd_bwd * bubble + optimizer + overhead
        # Pipeline transfers: the heaviest boundary, both directions, once per schedule slot.
        act_s = 0.0
        if pp > 1 and shape.out_bytes is not None:
            bounds = [lay.stage_bounds[s][1] - 1 for s in range(pp * virtual - 1)]
            msg = max(shape.out_bytes[b] for b in bounds)
            a, b = ab["ring"]
            act_s = 2 * (m * virtual + pp - 1) * (a + msg * b)
        last_backward = fwd_bwd / m * 2 / 3

        def row(compression: str, sync: str, algorithm: str, dp_comm: float, codec: float, hidden: float,
                sent: int, notes: str = "", configured: bool | None = None, compute: float = compute_s) -> dict:
            exposed = dp_comm - hidden + codec + act_s
            # Only an all-reduce of none, fp16 or bf16 shards the optimizer; other rows run whole.
            shard = shards[lay] if sync == "allreduce" and compression in ("none", "fp16", "bf16") else "none"
            mem = memory if shard != "none" else unsharded.get(lay, memory)
            return {
                "dp": dp, "pp": pp, "world_size": dp * pp, "micro_batches": m, "schedule": par.schedule,
                "stage_bounds": [list(b) for b in lay.stage_bounds],
                "compression": compression, "sync": sync, "algorithm": algorithm,
                "rank_params": rank_params, "compute_s": compute, "bubble": bubble, "dp_comm_s": dp_comm,
                # compute_s's parts, for re-pricing this layout under other shares or paces (balancing).
                "fwd_bwd_s": fwd_bwd, "optimizer_s": optimizer if sync != "parameter_server" else 0.0,
                "overhead_s": overhead, "virtual": virtual,
                "codec_s": codec, "hidden_s": hidden, "act_s": act_s, "exposed_comm_s": exposed,
                "total_s": compute + exposed, "comm_bytes": sent, "memory_bytes": mem,
                "activation_bytes": act_mem, "shard_optimizer": shard,
                "memory_unsharded_bytes": unsharded.get(lay, memory),
                "configured": ((dp, pp, compression, sync) == (par.dp, par.pp, c.compression, c.sync)
                               if configured is None else configured),
                "constants_source": source, "compute_source": rate_source,
                "notes": "; ".join([n for n in (notes, *shape_notes) if n]),
            }

        if dp == 1:
            # Nothing to average: every codec and every all-reduce-based sync mode runs the same step.
            if wanted(dp, "none", "allreduce"):
                rows.append(row("none", "allreduce", c.algorithm, 0.0, 0.0, 0.0, 0,
                                "dp=1: no gradient averaging, so every codec and sync mode but the parameter "
                                "server is this row", configured=(dp, pp) == (par.dp, par.pp)
                                and c.sync != "parameter_server"))
        else:
            for name in CODECS:
                if not wanted(dp, name, "allreduce"):
                    continue
                wire, sent, nb = dp_sync_cost(cfg, name, shapes, dp, ab)
                codec = rank_params * CODEC_S_PER_ELEMENT[name] * host * slowdown
                # Only buckets before the last can start during backward.
                hidden = min(overlap * wire * (nb - 1) / nb, last_backward)
                algorithm = c.algorithm if name in ALLREDUCE_CODECS else "backend"
                notes = "steady state, after powersgd_start_step" if name == "powersgd" else ""
                step_compute = compute_s
                if shards[lay] != "none" and name in ("none", "fp16", "bf16"):
                    # Sharded: AdamW on 1/dp of the parameters, and after it an fp32 all-gather of
                    # them (half a ring all-reduce's wire) that nothing hides.
                    wire += cost_model.predict("ring", 4 * rank_params, dp, *ab["ring"]) / 2
                    step_compute -= optimizer * (1 - 1 / dp)
                    notes = f"optimizer sharded ({shards[lay]}): AdamW on 1/{dp}, then an all-gather"
                rows.append(row(name, "allreduce", algorithm, wire, codec, hidden, sent, notes, compute=step_compute))
            # local SGD / DiLoCo: at a meeting, one ring all-reduce of all the rank's parameters (fp32),
            # or of their change since the last meeting (fp16 / bf16) (comm.local_sgd), after the
            # optimizer step, so nothing hides it; charged 1/local_steps per step.
            for name in ("none", *MEETING_CODECS):
                size = ALLREDUCE_CODECS[name]
                wire = cost_model.predict("ring", size * rank_params, dp, *ab["ring"])
                sent = bytes_sent("ring", rank_params, dp, 0, element_size=size)
                codec = rank_params * CODEC_S_PER_ELEMENT[name] * host * slowdown
                what = "parameters averaged" if name == "none" else f"changes averaged in {name}"
                for sync in MEETING_SYNCS:
                    if wanted(dp, name, sync):
                        rows.append(row(name, sync, "ring", wire / c.local_steps, codec / c.local_steps, 0.0,
                                        sent // c.local_steps, f"{what} every {c.local_steps} steps"))
        if not wanted(dp, "none", "parameter_server"):
            continue
        # Parameter server (comm.parameter_server, controller.ps_group): a worker pushes its gradients and
        # pulls its parameters; every shard lives on the controller's node, so that node's link carries
        # all dp replicas' gradients of every stage: cost_model's "ps" with one server (shards=1) when
        # pp == 1. The shards, not the workers, run AdamW, each on its share of the parameters, after
        # the last push. Even one replica pays the round trip: the parameters live on the shards.
        a, b = ab["ps"]
        n_rank, n_all = 4 * rank_params, 4 * total_params
        ps_s = 2 * a + 2 * max(n_rank, dp * n_all) * b
        shard_adamw = math.ceil(total_params / c.ps_shards) * opt_cost * slowdown
        rows.append(row("none", "parameter_server", "ps", ps_s, shard_adamw, 0.0, 2 * n_rank,
                        f"{c.ps_shards} shard(s) on one node; alpha/beta from {ps_how}, with the push/pull byte "
                        "pattern; codec_s is the shard's AdamW step, and the worker runs none; bytes are push + "
                        "pull, as the worker counts them",
                        compute=fwd_bwd * bubble + overhead))
    if worker_memory_bytes is not None:
        # A layout sized sharded fits, but its rows that cannot shard (int8, top-k, ...) may not.
        rows = [r for r in rows if r["memory_bytes"] <= worker_memory_bytes]
    rows.sort(key=rank_key)
    return rows


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def _label(r: dict) -> str:
    algo = f" ({r['algorithm']})" if r["sync"] == "allreduce" and r["compression"] == "none" else ""
    return f"dp={r['dp']} pp={r['pp']} {r['compression']}{algo} {r['sync']}"


def recommend(rows: Sequence[dict]) -> tuple[dict, str]:
    """The row with the lowest predicted step time, and why: its time vs the runner-up's and the config's.

    ``rows`` are :func:`predict_candidates`'s (any order), ranked by
    :func:`rank_key`, as the re-plan after a failure ranks them.
    """
    if not rows:
        raise ConfigError("recommend needs at least one candidate row; predict_candidates gave none")
    missing = [k for k in ("total_s", "dp", "pp", "compression", "sync") if k not in rows[0]]
    if missing:
        raise ConfigError(f"recommend needs rows from predict_candidates; the first row lacks {', '.join(missing)}")
    ranked = sorted(rows, key=rank_key)
    best = ranked[0]
    parts = [f"{_label(best)}: predicted {best['total_s'] * 1e3:.1f} ms/step "
             f"(compute {best['compute_s'] * 1e3:.1f} ms, exposed comm {best['exposed_comm_s'] * 1e3:.1f} ms)"]
    if len(ranked) > 1:
        nxt = ranked[1]
        parts.append(f"runner-up {_label(nxt)} {nxt['total_s'] * 1e3:.1f} ms "
                     f"({_ratio(nxt['total_s'], best['total_s'])})")
    caveat = _CAVEATS.get(best["sync"]) or _CAVEATS.get(best["compression"])
    if caveat and best["sync"] in MEETING_SYNCS and best["compression"] != "none":
        caveat += f"; its meetings send the change in {best['compression']}, which rounds the change, not the weights"
    if caveat:
        parts.append(caveat)
    conf = next((r for r in ranked if r.get("configured")), None)
    if conf is None:
        parts.append("the config as given is not among these candidates (its dp x pp does not fit the workers)")
    elif conf is best:
        parts.append("this is the config as given")
    else:
        parts.append(f"config as given {_label(conf)} {conf['total_s'] * 1e3:.1f} ms "
                     f"({_ratio(conf['total_s'], best['total_s'])})")
    return best, "; ".join(parts)


# What a faster step may cost elsewhere: the step time is not the whole story for these. The
# figures are the demo GPT's loss over the last 10 of 60 steps at dp=2 against all-reduce's
# (tests/integration/test_comm_modes.py, docs/communication.md); another model's will differ.
_CAVEATS = {
    "local_sgd": "note: local_sgd averages the model only every local_steps steps, so the loss per step is not "
                 "allreduce's (the demo at step 60: within 5%); compare time to a target loss before switching",
    "diloco": "note: diloco averages the model only every local_steps steps (with an outer Nesterov step), so "
              "the loss per step is not allreduce's (the demo at step 60: within 5%); compare time to a "
              "target loss before switching",
    "int8": "note: int8 is lossy, error feedback carries what it drops (the demo at step 60: within 5% of "
            "allreduce's loss)",
    "topk": "note: topk sends only a share of the gradient, error feedback carries the rest (the demo at step 60: "
            "8.7% behind allreduce's loss with a 30-step warm-up, 18% without); compare time to a target loss "
            "before switching",
    "powersgd": "note: powersgd sends a low-rank approximation, error feedback carries the rest (the demo at "
                "step 60: within 5% of allreduce's loss)",
}


def _ratio(other: float, best: float) -> str:
    if best <= 0:
        return "same" if other <= 0 else "slower"
    return f"{other / best:.2f}x the winner's time"


def format_candidates(rows: Sequence[dict]) -> str:
    """The rows as a table: layout, codec, sync, predicted compute / exposed comm / total in ms, bytes, memory."""
    head = (f"{'dp':>3} {'pp':>3} {'compression':>11} {'sync':>16} {'algorithm':>9} {'compute':>9} "
            f"{'comm':>9} {'total':>9} {'MB/step':>8} {'MB/worker':>9}  ")
    out = [head, f"{'':>3} {'':>3} {'':>11} {'':>16} {'':>9} {'(ms)':>9} {'(ms)':>9} {'(ms)':>9} {'':>8} {'':>9}"]
    for r in rows:
        out.append(f"{r['dp']:>3} {r['pp']:>3} {r['compression']:>11} {r['sync']:>16} {r['algorithm']:>9} "
                   f"{r['compute_s'] * 1e3:>9.2f} {r['exposed_comm_s'] * 1e3:>9.2f} {r['total_s'] * 1e3:>9.2f} "
                   f"{r['comm_bytes'] / 1e6:>8.3f} {r['memory_bytes'] / 1e6:>9.1f}"
                   + (f" (sharded {r['shard_optimizer']}; {r['memory_unsharded_bytes'] / 1e6:.1f} whole)"
                      if r.get("shard_optimizer", "none") != "none" else "")
                   + ("  <- as configured" if r["configured"] else ""))
    if rows:
        out.append(f"(comm: exposed DP sync + codec arithmetic + pipeline transfers; MB/step: DP bytes the "
                   f"heaviest rank sends, push + pull for parameter_server; MB/worker: what the rank that needs "
                   f"the most holds, for the run's own codec and sync (each buffer: the memory table below); constants: {rows[0]['constants_source']}; "
                   f"compute: {rows[0]['compute_source']})")
    return "\n".join(out)
