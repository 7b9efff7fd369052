"""Predicted step time of every layout, gradient codec and sync mode a job could run with; pick the fastest.

Pure (torch on the meta device, no Ray), so ``elastic-trainer plan`` and
tests call it directly. One row per feasible ``dp x pp`` on at most
``workers`` workers (the layouts of :func:`planning.policy.candidate_plans`,
same stage cut) times each codec under ``sync: allreduce`` plus the
``local_sgd``, ``diloco`` and ``parameter_server`` modes (uncompressed, as
the config requires). The heaviest rank sets the pace, so every term is
that rank's:

- compute: ``6 * params * tokens_per_replica / flops_per_s`` (forward +
  backward, the usual 2 + 4 FLOPs per parameter and token), stretched by
  the pipeline bubble ``(m + pp - 1) / m`` (``(m + (pp - 1) / v) / m``
  interleaved), plus the optimizer step at a measured cost per parameter;
- DP gradient sync (as ``comm.grad_sync`` runs it): per bucket
  (``comm.bucket_mb``, packed like ``comm.buckets.make_buckets``).
  ``none``, ``fp16`` and ``bf16`` are an all-reduce of 4 or 2 bytes an
  element with the configured algorithm, :func:`cost_model.predict`; int8,
  topk and powersgd run their own collectives on the backend (all-to-all,
  all-gather, ring all-reduce), ``latency_steps * alpha + wire_bytes * beta``
  at the ring's constants, ``wire_bytes`` from
  :func:`compression.expected_bytes` on the bucket's parameter shapes; plus
  each codec's own arithmetic at a measured cost per element;
- overlap: with ``comm.overlap`` every bucket but the last can run during
  backward; at most :data:`OVERLAP_EFFICIENCY` of that comm is taken as
  hidden, and never more than the last micro-batch's backward;
- ``local_sgd`` / ``diloco``: one fp32 ring all-reduce of the rank's
  parameters every ``local_steps`` steps, charged ``1 / local_steps`` per
  step, not hidden;
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

``total_s = compute_s + exposed_comm_s``. Numbers are the steady state:
PowerSGD after ``powersgd_start_step``, error feedback included in the
codec cost.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from ..config import TrainerConfig
from ..errors import ConfigError
from ..models.factory import build_blocks
from ..parallel.partition import stage_indices_for_rank
from . import cost_model
from ..comm.algorithms import bytes_sent
from ..comm.compression import CODECS, expected_bytes, make_codec

# Built-in alpha-beta constants, measured on the development machine (2 vCPUs,
# so the 4 ranks share 2 cores) on 2026-11-29 at 12:01 UTC with
#     elastic-trainer bench-comm --procs 4 --out constants.json
# (gloo over loopback TCP, 1 KiB .. 256 MiB doubling, 10 iterations, nothing
# else running). Relative RMS residuals: ring 0.17, tree 0.31, chunked 0.26.
# Peak busbw: ring 1.16, tree 0.92, chunked 1.06 GB/s against 5.1 GB/s for
# one loopback TCP stream. Four other sweeps that day (three with other jobs
# on the machine; one quiet, `python benchmarks/comm.py --only-sweep` at
# 12:04 UTC: ring 865 us, 0.78 GB/s) gave ring alpha 0.55-1.1 ms and
# 0.71-1.12 GB/s: on this shared 2-vCPU machine they move by tens of percent.
# A constants file from bench-comm on the target machine replaces them; on
# real networks they are far off.
DEFAULT_CONSTANTS = {
    "kind": "elastic_trainer.comm_constants",
    "version": 1,
    "measured_at": "2026-11-29T12:01:35+00:00",
    "command": "elastic-trainer bench-comm --procs 4 --min 1KiB --max 256MiB --algorithms ring,tree,chunked "
               "--iters 10",
    "procs": 4,
    "backend": "gloo",
    "loopback_Bps": 5.117e9,
    "algorithms": {
        "ring": {"alpha_s": 858.46e-6, "beta_s_per_byte": 0.80376e-9},
        "tree": {"alpha_s": 1183.71e-6, "beta_s_per_byte": 1.06077e-9},
        "chunked": {"alpha_s": 726.98e-6, "beta_s_per_byte": 0.81796e-9},
        # Through Ray, not gloo: `python benchmarks/comm.py` (2026-11-29, 15:20 UTC) timed 4 simulated
        # nodes each sending 256 KiB-8 MiB to an actor on the head node and back; the object store's
        # transfers cost ~15 ms a message here, 20x the ring's latency.
        "ps": {"alpha_s": 15.1217e-3, "beta_s_per_byte": 0.80576e-9,
               "derived_from": "Ray echo: 4 nodes x N bytes to an actor on the head node and back"},
    },
}

# One torch thread on the development machine (2026-11-29, quiet), the demo
# GPT (jobs/demo.yaml: 875,264 parameters) at micro-batch 4 x 128 tokens,
# forward + backward, median of 10 steps after 2: 61-65 GFLOP/s for 1-4
# micro-batches by the 6 * params * tokens count (which leaves out attention,
# ~15% more at this size: absorbed here).
DEFAULT_FLOPS_PER_S = 62e9
# AdamW step on the same model: 3.1 ms for 875k parameters.
DEFAULT_OPTIMIZER_S_PER_PARAM = 3.6e-9
# Codec arithmetic per fp32 gradient element (encode, decode, error
# feedback), one thread, the demo GPT's 875k-element bucket at p = 4 with
# the collectives replaced by copies, median of 12 calls, same day. PowerSGD's
# depends on the shapes and rank; this is rank 4 on the demo.
CODEC_S_PER_ELEMENT = {"none": 0.12e-9, "fp16": 0.87e-9, "bf16": 0.89e-9, "int8": 5.8e-9, "topk": 9.3e-9,
                       "powersgd": 5.0e-9}
# Share of the overlappable comm assumed hidden behind backward. Not measured:
# on CPU gloo's transfer threads compete with backward for the worker's core,
# so half; NCCL on its own stream hides nearly all of it.
OVERLAP_EFFICIENCY = {"gloo": 0.5, "nccl": 0.9}

_COMPUTE_KEYS = ("flops_per_s", "seconds", "params", "tokens", "cpus", "optimizer_s_per_param", "step_overhead_s")


# -- inputs --------------------------------------------------------------------------------------
def load_constants(path: str | Path) -> dict:
    """Read and check a constants JSON written by ``elastic-trainer bench-comm --out``.

    Besides ``algorithms`` it may hold ``compute``, the compute dict of
    :func:`predict_candidates` for the machine it describes; ``plan`` uses it.
    """
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"constants file {str(path)!r} does not exist; write one with "
                          f"`elastic-trainer bench-comm --out {path}`") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"constants file {str(path)!r} is not JSON: {e}") from None
    _alpha_beta(doc, str(path))
    return {**doc, "source": str(path)}


def _alpha_beta(constants: dict, source: str) -> dict[str, tuple[float, float]]:
    """``{algorithm: (alpha, beta)}`` from a constants document (or a bare ``{algorithm: fit}`` dict)."""
    if not isinstance(constants, dict):
        raise ConfigError(f"the constants ({source}) must be a JSON object; got {type(constants).__name__}")
    table = constants.get("algorithms", constants)
    out = {}
    for name, fit in table.items() if isinstance(table, dict) else ():
        if name not in cost_model.MODELS:
            continue
        try:
            alpha, beta = float(fit["alpha_s"]), float(fit["beta_s_per_byte"])
        except (TypeError, KeyError, ValueError):
            raise ConfigError(f"the constants ({source}): {name!r} needs numeric alpha_s and beta_s_per_byte; "
                              f"got {fit!r}") from None
        if not (math.isfinite(alpha) and math.isfinite(beta)) or alpha < 0 or beta < 0:
            raise ConfigError(f"the constants ({source}): {name!r} has alpha_s={alpha}, beta_s_per_byte={beta}; "
                              "both must be finite and >= 0 (a negative fit means the sweep did not look "
                              "like the model: measure again, on a quieter machine or with more --iters)")
        out[name] = (alpha, beta)
    if "ring" not in out:
        raise ConfigError(f"the constants ({source}) have no 'ring' entry (found {', '.join(sorted(out)) or 'none'}); the "
                          "codecs, local SGD, DiLoCo and the parameter server are all priced at the ring's "
                          "constants. Measure with `elastic-trainer bench-comm --algorithms ring,...`")
    out.setdefault("ps", out["ring"])
    return out


def _flops_rate(compute: dict | None) -> tuple[float, float, float | None, str]:
    """(FLOP/s of one worker, optimizer s/param, cores shared by all workers or None, source)."""
    if compute is None:
        return DEFAULT_FLOPS_PER_S, DEFAULT_OPTIMIZER_S_PER_PARAM, None, "built-in"
    if not isinstance(compute, dict):
        raise ConfigError(f"compute must be a dict with keys from {', '.join(_COMPUTE_KEYS)}; "
                          f"got {type(compute).__name__}")
    unknown = sorted(set(compute) - set(_COMPUTE_KEYS))
    if unknown:
        raise ConfigError(f"compute got unknown key(s) {', '.join(unknown)}; valid: {', '.join(_COMPUTE_KEYS)}")
    if "flops_per_s" in compute:
        rate, source = float(compute["flops_per_s"]), "given flops_per_s"
    elif {"seconds", "params", "tokens"} <= set(compute):
        s, n, t = float(compute["seconds"]), float(compute["params"]), float(compute["tokens"])
        if s <= 0 or n <= 0 or t <= 0:
            raise ConfigError(f"compute seconds, params and tokens must be > 0; got seconds={s}, params={n}, "
                              f"tokens={t}")
        rate, source = 6 * n * t / s, f"measured: {n:.0f} params x {t:.0f} tokens in {s * 1e3:.1f} ms"
    elif "seconds" in compute or "params" in compute or "tokens" in compute:
        given = sorted(set(compute) & {"seconds", "params", "tokens"})
        raise ConfigError(f"compute from a measurement needs all of seconds, params and tokens; got only "
                          f"{', '.join(given)}")
    else:
        rate, source = DEFAULT_FLOPS_PER_S, "built-in"
    if not (rate > 0 and math.isfinite(rate)):
        raise ConfigError(f"compute rate must be a finite number > 0 FLOP/s; got {rate}")
    opt = float(compute.get("optimizer_s_per_param", DEFAULT_OPTIMIZER_S_PER_PARAM))
    cpus = compute.get("cpus")
    # cpus may be fractional: the cores workers effectively get when they share them (see
    # benchmarks/comm.py, measure_colocated).
    if opt < 0 or (cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, (int, float))
                                         or not cpus > 0 or not math.isfinite(cpus))):
        raise ConfigError(f"compute optimizer_s_per_param must be >= 0 and cpus a number > 0; got "
                          f"optimizer_s_per_param={opt}, cpus={cpus!r}")
    return rate, opt, cpus, source


# -- the model's shape ---------------------------------------------------------------------------
def _model_shapes(cfg: TrainerConfig) -> tuple[list[list[tuple[int, ...]]], list[int] | None, str | None]:
    """(parameter shapes per block, activation bytes leaving each block per micro-batch, why those are unknown).

    Everything is built on the meta device: no memory, no arithmetic. The
    activations come from a forward of one micro-batch of token ids; a model
    that cannot run on the meta device gets ``None`` and the reason.
    """
    with torch.device("meta"):
        blocks, _ = build_blocks(cfg.model, seed=0)
        shapes = [[tuple(p.shape) for p in b.parameters()] for b in blocks]
        x = torch.zeros(cfg.train.micro_batch_size, cfg.data.seq_len, dtype=torch.long)
        act: list[int] | None = []
        why = None
        try:
            with torch.no_grad():
                for b in blocks:
                    x = b(x)
                    if not isinstance(x, torch.Tensor):
                        raise TypeError(f"block {type(b).__name__} returned {type(x).__name__}, not a tensor")
                    act.append(x.numel() * x.element_size())
        except Exception as e:  # any model code may fail on meta tensors
            act, why = None, f"{type(e).__name__}: {e}"
    return shapes, act, why


def _buckets(shapes: list[tuple[int, ...]], bucket_bytes: int) -> list[list[tuple[int, tuple[int, ...]]]]:
    """``[(offset, shape)]`` per bucket, packed as ``comm.buckets.make_buckets`` packs fp32 gradients."""
    buckets: list[list[tuple[int, tuple[int, ...]]]] = []
    current: list[tuple[int, tuple[int, ...]]] = []
    size = 0
    for shape in reversed(shapes):
        n = math.prod(shape)
        if current and size + 4 * n > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((size // 4, shape))
        size += 4 * n
    if current:
        buckets.append(current)
    return buckets


# -- costs ---------------------------------------------------------------------------------------
def _codec_opts(cfg: TrainerConfig, name: str) -> dict:
    c = cfg.comm
    if name == "topk":
        return {"ratio": c.topk_ratio}
    if name == "powersgd":
        return {"rank": c.powersgd_rank, "start_step": c.powersgd_start_step}
    return {}


# The codecs whose collective is an all-reduce, which the configured algorithm
# runs (comm.grad_sync); the others build theirs from all-to-all / all-gather.
_ALLREDUCE_CODECS = {"none": 4, "fp16": 2, "bf16": 2}


def _latency_steps(name: str, p: int, bucket: list[tuple[int, tuple[int, ...]]], numel: int, opts: dict) -> int:
    """Sequential messages of one bucket's collectives: a ring all-reduce takes ``2(p-1)``, all-gather ``p-1``."""
    if name == "int8":
        return 2 * (p - 1)  # all-to-all, then all-gather
    if name == "topk":
        return p - 1
    # PowerSGD: an all-reduce of P with the uncompressed entries, and one of Q if any matrix is compressed.
    matrices, rest = make_codec("powersgd", **opts)._plan(numel, bucket)
    first = rest.numel() + sum(n * r for _, n, _, r in matrices)
    return 2 * (p - 1) * ((first > 0) + bool(matrices))


def dp_sync_cost(cfg: TrainerConfig, compression: str, shapes: list[tuple[int, ...]], p: int,
                 ab: dict[str, tuple[float, float]], algorithm: str | None = None) -> tuple[float, int, int]:
    """(seconds on the wire, bytes one rank sends, buckets) to average gradients of ``shapes`` over ``p`` ranks.

    ``none``, ``fp16`` and ``bf16`` all-reduce with ``algorithm`` (default
    ``cfg.comm.algorithm``) at 4 or 2 bytes an element, counting the busiest
    rank's bytes; int8, topk and powersgd run their own collectives on the
    backend, priced at the ring's constants.
    """
    if compression not in CODECS:
        raise ConfigError(f"unknown compression {compression!r}; valid: {', '.join(CODECS)}")
    algo = cfg.comm.algorithm if algorithm is None else algorithm
    if compression in _ALLREDUCE_CODECS and algo not in ab:
        raise ConfigError(f"all-reduce algorithm {algo!r} has no constants (found {', '.join(sorted(ab))}); "
                          f"measure it with `elastic-trainer bench-comm --algorithms {algo}`")
    buckets = _buckets(shapes, int(cfg.comm.bucket_mb * (1 << 20)))
    if p == 1:
        return 0.0, 0, len(buckets)
    opts = _codec_opts(cfg, compression)
    alpha, beta = ab["ring"]
    seconds, sent = 0.0, 0
    for bucket in buckets:
        numel = sum(math.prod(s) for _, s in bucket)
        if compression in _ALLREDUCE_CODECS:
            size = _ALLREDUCE_CODECS[compression]
            sent += max(bytes_sent(algo, numel, p, r, element_size=size) for r in range(p))
            seconds += cost_model.predict(algo, numel * size, p, *ab[algo])
        else:
            steps, nbytes = _codec_wire(compression, numel, p, tuple(bucket), tuple(sorted(opts.items())))
            sent += nbytes
            seconds += steps * alpha + nbytes * beta
    return seconds, sent, len(buckets)


# Layouts share their buckets, and PowerSGD's byte count walks every element: remember each answer.
@functools.lru_cache(maxsize=4096)
def _codec_wire(name: str, numel: int, p: int, bucket: tuple, opts: tuple) -> tuple[int, int]:
    """(sequential messages, bytes one rank sends) for codec ``name`` on one bucket."""
    kw = dict(opts)
    return _latency_steps(name, p, list(bucket), numel, kw), expected_bytes(name, numel, p, shapes=bucket, **kw)


def _bubble(schedule: str, m: int, pp: int, virtual: int) -> float:
    if pp == 1:
        return 1.0
    if schedule == "interleaved":
        return (m + (pp - 1) / virtual) / m
    return (m + pp - 1) / m


# -- candidates ----------------------------------------------------------------------------------
def predict_candidates(cfg: TrainerConfig, workers: int, constants: dict | None = None,
                       compute: dict | None = None) -> list[dict]:
    """Predicted step time of every feasible layout x (codec | sync mode) on at most ``workers`` workers.

    ``constants``: a document from :func:`load_constants` (or
    :func:`bench.constants_document`), default :data:`DEFAULT_CONSTANTS`.
    ``compute``: ``{"flops_per_s": r}``, or a measurement ``{"seconds": s,
    "params": n, "tokens": t}`` (one worker's forward + backward of ``n``
    parameters over ``t`` tokens took ``s``), optionally with ``"cpus": c``
    when all workers share ``c`` cores (a simulated cluster: each worker then
    runs at ``c / world_size`` of the rate), ``"optimizer_s_per_param"`` and
    ``"step_overhead_s"``: what a step costs besides forward, backward, the
    optimizer and communication (reading the batch, dispatching the step,
    Python), measured by a run that does not communicate; default 0.

    Rows are sorted fastest first; each has ``dp, pp, world_size,
    micro_batches, compression, sync, algorithm, compute_s, bubble,
    dp_comm_s, codec_s, hidden_s, act_s, exposed_comm_s, total_s,
    comm_bytes`` (what the heaviest rank sends per step for DP sync),
    ``rank_params``, ``configured`` (the job's own layout, codec and sync)
    and ``notes``.
    """
    from .policy import candidate_plans

    if not isinstance(cfg, TrainerConfig):
        raise ConfigError(f"predict_candidates needs a TrainerConfig; got {type(cfg).__name__}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be an int >= 1; got {workers!r}")
    doc = DEFAULT_CONSTANTS if constants is None else constants
    source = doc.get("source") or (f"built-in ({DEFAULT_CONSTANTS['command']}, {DEFAULT_CONSTANTS['measured_at']})"
                                   if constants is None else "passed in")
    ab = _alpha_beta(doc, source)
    ps_entry = (doc.get("algorithms") or {}).get("ps") or {}
    ps_how = ps_entry.get("derived_from", "measured") if ps_entry else "ring"
    rate, opt_cost, cpus, rate_source = _flops_rate(compute)
    overhead = float((compute or {}).get("step_overhead_s", 0.0))
    if not (math.isfinite(overhead) and overhead >= 0):
        raise ConfigError(f"compute step_overhead_s must be a finite number >= 0; got {overhead}")
    backend = cfg.scaling.resolved_backend()
    overlap = OVERLAP_EFFICIENCY.get(backend, 0.5) if cfg.comm.overlap else 0.0

    block_shapes, act_bytes, act_why = _model_shapes(cfg)
    counts = [sum(math.prod(s) for s in b) for b in block_shapes]
    total_params = sum(counts)
    plans = candidate_plans(cfg, counts, workers, None)
    if not plans:
        raise ConfigError(
            f"no dp x pp fits {workers} worker(s): global_batch_size({cfg.train.global_batch_size}) must divide "
            f"by dp * micro_batch_size({cfg.train.micro_batch_size}) for some dp <= {workers}"
            + (", and 'interleaved' needs pp >= 2" if cfg.parallel.schedule == "interleaved" else ""))
    t, par, c = cfg.train, cfg.parallel, cfg.comm
    virtual = par.stages_per_rank
    rows = []
    for plan in plans:
        dp, pp = plan.dp, plan.pp
        if pp > 1 and act_bytes is None:
            raise ConfigError(f"cannot size the activations between pipeline stages: the model does not run "
                              f"on the meta device ({act_why}); plan with --workers 1, or make the model's "
                              "forward work on meta tensors")
        # The heaviest rank (with interleaving a rank holds `virtual` stages).
        ranks = []
        for r in range(pp):
            stages = stage_indices_for_rank(r, pp, virtual)
            shapes = [s for st in stages for blk in range(*plan.stage_bounds[st]) for s in block_shapes[blk]]
            ranks.append((sum(math.prod(s) for s in shapes), shapes))
        rank_params, shapes = max(ranks, key=lambda x: x[0])
        m = t.global_batch_size // (dp * t.micro_batch_size)
        per_worker = rate * (min(1.0, cpus / (dp * pp)) if cpus else 1.0)
        tokens = t.global_batch_size // dp * cfg.data.seq_len
        fwd_bwd = 6 * rank_params * tokens / per_worker
        bubble = _bubble(par.schedule, m, pp, virtual)
        slowdown = rate / per_worker
        optimizer = rank_params * opt_cost * slowdown
        compute_s = fwd_bwd * bubble + optimizer + overhead
        # Pipeline transfers: the heaviest boundary, both directions, once per schedule slot.
        act_s = 0.0
        if pp > 1:
            bounds = [plan.stage_bounds[s][1] - 1 for s in range(pp * virtual - 1)]
            msg = max(act_bytes[b] for b in bounds)
            a, b = ab["ring"]
            act_s = 2 * (m * virtual + pp - 1) * (a + msg * b)
        last_backward = fwd_bwd / m * 2 / 3

        def row(compression: str, sync: str, algorithm: str, dp_comm: float, codec: float, hidden: float,
                sent: int, notes: str = "", configured: bool | None = None, compute: float = compute_s) -> dict:
            exposed = dp_comm - hidden + codec + act_s
            return {
                "dp": dp, "pp": pp, "world_size": dp * pp, "micro_batches": m, "schedule": par.schedule,
                "compression": compression, "sync": sync, "algorithm": algorithm,
                "rank_params": rank_params, "compute_s": compute, "bubble": bubble, "dp_comm_s": dp_comm,
                "codec_s": codec, "hidden_s": hidden, "act_s": act_s, "exposed_comm_s": exposed,
                "total_s": compute + exposed, "comm_bytes": sent,
                "configured": ((dp, pp, compression, sync) == (par.dp, par.pp, c.compression, c.sync)
                               if configured is None else configured),
                "constants_source": source, "compute_source": rate_source, "notes": notes,
            }

        if dp == 1:
            # Nothing to average: every codec and every all-reduce-based sync mode runs the same step.
            rows.append(row("none", "allreduce", c.algorithm, 0.0, 0.0, 0.0, 0,
                            "dp=1: no gradient averaging, so every codec and sync mode but the parameter "
                            "server is this row", configured=(dp, pp) == (par.dp, par.pp)
                            and c.sync != "parameter_server"))
        else:
            for name in CODECS:
                wire, sent, nb = dp_sync_cost(cfg, name, shapes, dp, ab)
                codec = rank_params * CODEC_S_PER_ELEMENT[name] * slowdown
                # Only buckets before the last can start during backward.
                hidden = min(overlap * wire * (nb - 1) / nb, last_backward)
                algorithm = c.algorithm if name in _ALLREDUCE_CODECS else "backend"
                notes = "steady state, after powersgd_start_step" if name == "powersgd" else ""
                rows.append(row(name, "allreduce", algorithm, wire, codec, hidden, sent, notes))
            # local SGD / DiLoCo: at a meeting, one fp32 ring all-reduce of all the rank's parameters
            # (comm.local_sgd), after the optimizer step, so nothing hides it; charged 1/local_steps per step.
            wire = cost_model.predict("ring", 4 * rank_params, dp, *ab["ring"])
            sent = bytes_sent("ring", rank_params, dp, 0)
            for sync in ("local_sgd", "diloco"):
                rows.append(row("none", sync, "ring", wire / c.local_steps, 0.0, 0.0, sent // c.local_steps,
                                f"parameters averaged every {c.local_steps} steps"))
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
    rows.sort(key=lambda r: (round(r["total_s"], 12), -r["dp"], r["world_size"]))
    return rows


def _label(r: dict) -> str:
    algo = f" ({r['algorithm']})" if r["sync"] == "allreduce" and r["compression"] == "none" else ""
    return f"dp={r['dp']} pp={r['pp']} {r['compression']}{algo} {r['sync']}"


def recommend(rows: Sequence[dict]) -> tuple[dict, str]:
    """The row with the lowest predicted step time, and why: its time vs the runner-up's and the config's.

    ``rows`` are :func:`predict_candidates`'s (any order). Ties go to more
    replicas, then fewer workers, as :func:`planning.policy.candidate_plans`
    breaks them.
    """
    if not rows:
        raise ConfigError("recommend needs at least one candidate row; predict_candidates gave none")
    missing = [k for k in ("total_s", "dp", "pp", "compression", "sync") if k not in rows[0]]
    if missing:
        raise ConfigError(f"recommend needs rows from predict_candidates; the first row lacks {', '.join(missing)}")
    ranked = sorted(rows, key=lambda r: (round(r["total_s"], 12), -r["dp"], r["world_size"]))
    best = ranked[0]
    parts = [f"{_label(best)}: predicted {best['total_s'] * 1e3:.1f} ms/step "
             f"(compute {best['compute_s'] * 1e3:.1f} ms, exposed comm {best['exposed_comm_s'] * 1e3:.1f} ms)"]
    if len(ranked) > 1:
        nxt = ranked[1]
        parts.append(f"runner-up {_label(nxt)} {nxt['total_s'] * 1e3:.1f} ms "
                     f"({_ratio(nxt['total_s'], best['total_s'])})")
    caveat = _CAVEATS.get(best["sync"]) or _CAVEATS.get(best["compression"])
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


# What a faster step may cost elsewhere: the step time is not the whole story for these.
_CAVEATS = {
    "local_sgd": "note: local_sgd averages the model only every local_steps steps, so the loss per step is not "
                 "allreduce's; compare time to a target loss before switching",
    "diloco": "note: diloco averages the model only every local_steps steps (with an outer Nesterov step), so "
              "the loss per step is not allreduce's; compare time to a target loss before switching",
    "int8": "note: int8 is lossy (error feedback carries what it drops)",
    "topk": "note: topk sends only a share of the gradient (error feedback carries the rest)",
    "powersgd": "note: powersgd sends a low-rank approximation (error feedback carries the rest)",
}


def _ratio(other: float, best: float) -> str:
    if best <= 0:
        return "same" if other <= 0 else "slower"
    return f"{other / best:.2f}x the winner's time"


def format_candidates(rows: Sequence[dict]) -> str:
    """The rows as a table: layout, codec, sync, predicted compute / exposed comm / total in ms."""
    head = (f"{'dp':>3} {'pp':>3} {'compression':>11} {'sync':>16} {'algorithm':>9} {'compute':>9} "
            f"{'comm':>9} {'total':>9} {'MB/step':>8}  ")
    out = [head, f"{'':>3} {'':>3} {'':>11} {'':>16} {'':>9} {'(ms)':>9} {'(ms)':>9} {'(ms)':>9} {'':>8}"]
    for r in rows:
        out.append(f"{r['dp']:>3} {r['pp']:>3} {r['compression']:>11} {r['sync']:>16} {r['algorithm']:>9} "
                   f"{r['compute_s'] * 1e3:>9.2f} {r['exposed_comm_s'] * 1e3:>9.2f} {r['total_s'] * 1e3:>9.2f} "
                   f"{r['comm_bytes'] / 1e6:>8.3f}" + ("  <- as configured" if r["configured"] else ""))
    if rows:
        out.append(f"(comm: exposed DP sync + codec arithmetic + pipeline transfers; MB/step: DP bytes the "
                   f"heaviest rank sends, push + pull for parameter_server; constants: {rows[0]['constants_source']}; compute: "
                   f"{rows[0]['compute_source']})")
    return "\n".join(out)
