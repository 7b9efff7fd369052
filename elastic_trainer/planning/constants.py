"""The numbers the planner prices with: alpha-beta constants, compute rate, codec costs, and where they come from.

Built-in defaults were measured on the development machine; a run replaces
them with a constants JSON from ``elastic-trainer bench-comm --out``, named
by ``--constants`` or the config's ``comm.constants``.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

from ..config import TrainerConfig
from ..errors import ConfigError
from . import cost_model

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
# What a block's forward + backward costs besides its FLOPs (operator dispatch,
# autograd bookkeeping), per micro-batch: it sets the pace of small models,
# where the FLOP count alone is 15x short (the test GPT, d_model 32: 2.1 ms
# measured per micro-batch of 1 x 16 tokens against 0.14 ms of FLOPs). One
# torch thread, 2026-12-01, the GPT at d_model 32 with 2, 6, 12 and 24 layers,
# 1 x 16 tokens, median of 5 x 20 micro-batches (spread under 3%): a
# least-squares slope of 0.28 ms per block. Used with the built-in rate only:
# a measured rate (seconds, params, tokens) already includes it.
DEFAULT_BLOCK_OVERHEAD_S = 0.28e-3
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

_COMPUTE_KEYS = ("flops_per_s", "seconds", "params", "tokens", "cpus", "optimizer_s_per_param", "step_overhead_s",
                 "block_overhead_s")


def load_constants(path: str | Path) -> dict:
    """Read and check a constants JSON written by ``elastic-trainer bench-comm --out``.

    Besides ``algorithms`` it may hold ``compute``, the compute dict of
    :func:`planner.predict_candidates` for the machine it describes; ``plan`` and the
    re-plan after a failure use it.
    """
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"constants file {str(path)!r} does not exist; write one with "
                          f"`elastic-trainer bench-comm --out {path}`") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"constants file {str(path)!r} is not JSON: {e}") from None
    alpha_beta(doc, str(path))
    return {**doc, "source": str(path)}


def alpha_beta(constants: dict, source: str) -> dict[str, tuple[float, float]]:
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


def flops_rate(compute: dict | None) -> tuple[float, float, float | None, float, str]:
    """(FLOP/s of one worker, optimizer s/param, cores shared by all workers or None,
    s per block per micro-batch besides FLOPs, source)."""
    if compute is None:
        return DEFAULT_FLOPS_PER_S, DEFAULT_OPTIMIZER_S_PER_PARAM, None, DEFAULT_BLOCK_OVERHEAD_S, "built-in"
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
    block = float(compute.get("block_overhead_s", DEFAULT_BLOCK_OVERHEAD_S if source == "built-in" else 0.0))
    if not (math.isfinite(block) and block >= 0):
        raise ConfigError(f"compute block_overhead_s must be a finite number >= 0; got {block}")
    return rate, opt, cpus, block, source


def run_constants(cfg: TrainerConfig) -> dict | None:
    """The constants document ``cfg.comm.constants`` names, or None for the built-ins.

    Read once per file version: the re-plan after a failure calls this on the
    recovery path, where re-reading and re-checking JSON would only add time.
    """
    if cfg.comm.constants is None:
        return None
    path = os.path.expanduser(cfg.comm.constants)
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        stamp = None  # load_constants names the missing file
    return _load_cached(str(path), stamp)


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, stamp: int | None) -> dict:
    return load_constants(path)
