"""Seconds and bytes of one step's data-parallel gradient averaging, as ``comm.grad_sync`` runs it.

Gradients are packed into buckets of ``comm.bucket_mb`` (as
``comm.buckets.make_buckets`` packs them) and each bucket is averaged on its
own. ``none``, ``fp16`` and ``bf16`` are an all-reduce of 4 or 2 bytes an
element with the configured algorithm, priced by :func:`cost_model.predict`;
int8, topk and powersgd run their own collectives on the backend
(all-to-all, all-gather, ring all-reduce): ``latency_steps * alpha +
wire_bytes * beta``, ``wire_bytes`` from :func:`compression.expected_bytes`
on the bucket's parameter shapes, at the constants of the exchange they go
through (``allgather``, ``alltoall``) where the calibration timed it, else
at the ring's.
"""

from __future__ import annotations

import functools
import math

from ..comm.algorithms import bytes_sent
from ..comm.compression import CODECS, expected_bytes, make_codec
from ..config import TrainerConfig
from ..errors import ConfigError
from . import cost_model


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


def _codec_opts(cfg: TrainerConfig, name: str) -> dict:
    c = cfg.comm
    if name == "topk":
        return {"ratio": c.topk_ratio, "exchange": c.topk_exchange}
    if name == "powersgd":
        return {"rank": c.powersgd_rank, "start_step": c.powersgd_start_step}
    return {}


# The codecs whose collective is an all-reduce, which the configured algorithm
# runs (comm.grad_sync); the others build theirs from all-to-all / all-gather.
ALLREDUCE_CODECS = {"none": 4, "fp16": 2, "bf16": 2}


def _latency_steps(name: str, p: int, bucket: list[tuple[int, tuple[int, ...]]], numel: int, opts: dict) -> int:
    """Sequential messages of one bucket's collectives: a ring all-reduce takes ``2(p-1)``, all-gather ``p-1``."""
    if name == "int8":
        return 2 * (p - 1)  # all-to-all, then all-gather
    if name == "topk":
        # All-gather; sparse_reduce runs an all-to-all before it.
        return (p - 1) * (2 if opts.get("exchange") == "sparse_reduce" else 1)
    # PowerSGD: an all-reduce of P with the uncompressed entries, and one of Q if any matrix is compressed.
    matrices, rest = make_codec("powersgd", **opts)._plan(numel, bucket)
    first = sum(hi - lo for lo, hi in rest) + sum(n * r for _, n, _, r in matrices)
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
    if compression in ALLREDUCE_CODECS and algo not in ab:
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
        if compression in ALLREDUCE_CODECS:
            size = ALLREDUCE_CODECS[compression]
            sent += max(bytes_sent(algo, numel, p, r, element_size=size) for r in range(p))
            seconds += cost_model.predict(algo, numel * size, p, *ab[algo])
        else:
            steps, nbytes = _codec_wire(compression, numel, p, tuple(bucket), tuple(sorted(opts.items())))
            sent += nbytes
            # The backend's own all-gather / all-to-all, at their constants where the sweep timed
            # them (a backend need not run them at the ring's pace), else at the ring's.
            for exchange, share in _EXCHANGE_SHARES.get((compression, opts.get("exchange")), (("ring", 1.0),)):
                a, b = ab.get(exchange, (alpha, beta))
                seconds += share * (steps * a + nbytes * b)
    return seconds, sent, len(buckets)


# The share of a codec's messages and bytes that goes through each exchange: int8 sends an
# all-to-all then an all-gather of the same width; top-k an all-gather (sparse_reduce: an
# all-to-all first). PowerSGD's are ring all-reduces.
_EXCHANGE_SHARES = {
    ("int8", None): (("alltoall", 0.5), ("allgather", 0.5)),
    ("topk", "allgather"): (("allgather", 1.0),),
    ("topk", "sparse_reduce"): (("alltoall", 0.5), ("allgather", 0.5)),
}


# Layouts share their buckets, and PowerSGD's byte count walks every element: remember each answer.
@functools.lru_cache(maxsize=4096)
def _codec_wire(name: str, numel: int, p: int, bucket: tuple, opts: tuple) -> tuple[int, int]:
    """(sequential messages, bytes one rank sends) for codec ``name`` on one bucket."""
    kw = dict(opts)
    return _latency_steps(name, p, list(bucket), numel, kw), expected_bytes(name, numel, p, shapes=bucket, **kw)
