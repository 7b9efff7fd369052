"""Alpha-beta cost model of gradient averaging and its fit from measurements.

A message of ``n`` bytes costs ``alpha + n * beta`` (latency plus inverse
bandwidth); an algorithm's time is its number of sequential messages times
alpha plus the bytes on its busiest link times beta. Reduction arithmetic is
left out: on the links this targets it hides behind the wire. Every
prediction is linear in ``(alpha, beta)``, which is what lets :func:`fit`
recover both from timings of any one algorithm.

Pure arithmetic, no collectives: the sweep that measures lives in
:mod:`planning.calibration`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ..comm.algorithms import DEFAULT_CHUNK_BYTES

MODELS = ("ring", "tree", "chunked", "ps", "allgather", "alltoall")
# Not all-reduces: the backend's own all-gather and all-to-all, which the int8 and top-k codecs send
# through. The calibration sweep times them apart, since a backend need not run them at the ring's pace.
EXCHANGES = ("allgather", "alltoall")


def predict(algorithm: str, nbytes: float, p: int, alpha: float, beta: float, *, gamma: float = 0.0,
            shards: int | None = None, colocated: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> float:
    """Seconds to all-reduce ``nbytes`` (``N``) over ``p`` ranks with ``algorithm`` (one of :data:`MODELS`).

    ``gamma`` (s/byte) prices the reduction arithmetic that is not hidden behind
    the wire; it defaults to 0, the plain alpha-beta model.

    - ``ring``: ``2(p-1) a + 2(p-1)/p N b + (p-1)/p N g``.
    - ``tree`` (recursive halving-doubling, ``p2`` = largest power of two <= p):
      ``2 log2(p2) a + 2(p2-1)/p2 N b + (p2-1)/p2 N g``, plus ``2 a + 2 N b + N g``
      when ``p != p2``, for the ranks that fold their vector into a partner
      and get the result back.
    - ``chunked`` (the ring with each segment of ``N/p`` cut into ``C`` chunks
      of at most ``chunk_bytes``, chunks one ring step apart):
      ``(2(p-1) + C - 1) a + 2(p-1)/p N b + (p-1)/p N g / C``. The link carries
      the ring's bytes either way; chunks add pipeline-fill latency and buy
      back the reduction time, which overlaps the transfer of later chunks.
    - ``ps`` (parameter server, ``S = shards`` servers, default ``p``, each
      owning ``N/S``): a worker pushes ``N`` split over the shards and pulls
      ``N`` back, one message latency each way, while a shard takes
      ``p N/S`` in and sends as much out: ``2 a + 2 max(N, p N/S) b + p N/S g``.
      With ``colocated`` shards (shard ``i`` on worker ``i``, ``S <= p``) a
      worker's own slice stays local: ``2 a + 2 max(N (1 - 1/S), (p-1) N/S) b
      + p N/S g``; for ``S = p`` that is the ring's bytes with two latencies
      instead of ``2(p-1)``, bought with ``p-1`` simultaneous peers per rank.
    - ``allgather`` and ``alltoall`` (no reduction: ``N`` is the output, ``N/p``
      from each rank): ``(p-1) a + (p-1)/p N b``; fitted apart, each its own
      ``a`` and ``b``.
    """
    if p < 1 or nbytes < 0:
        raise ValueError(f"predict needs p >= 1 and nbytes >= 0; got p={p}, nbytes={nbytes}")
    if algorithm not in MODELS:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: {', '.join(MODELS)}")
    if p == 1:
        return 0.0
    n = float(nbytes)
    ring_bytes = 2 * (p - 1) / p * n
    if algorithm == "ring":
        return 2 * (p - 1) * alpha + ring_bytes * beta + (p - 1) / p * n * gamma
    if algorithm == "tree":
        p2 = 1 << (p.bit_length() - 1)
        fold = p != p2
        steps = 2 * int(math.log2(p2)) + 2 * fold
        return (steps * alpha + (2 * (p2 - 1) / p2 * n + 2 * n * fold) * beta
                + ((p2 - 1) / p2 * n + n * fold) * gamma)
    if algorithm in EXCHANGES:
        return (p - 1) * alpha + (p - 1) / p * n * beta
    if algorithm == "chunked":
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1; got {chunk_bytes}")
        chunks = max(1, math.ceil(n / p / chunk_bytes))
        return (2 * (p - 1) + chunks - 1) * alpha + ring_bytes * beta + (p - 1) / p * n * gamma / chunks
    s = p if shards is None else shards
    if s < 1 or (colocated and s > p):
        raise ValueError(f"ps needs 1 <= shards{' <= p' if colocated else ''}; got shards={s}, p={p}")
    link = max(n * (1 - 1 / s), (p - 1) * n / s) if colocated else max(n, p * n / s)
    return 2 * alpha + 2 * link * beta + p * n / s * gamma


@dataclass(frozen=True)
class Fit:
    """Fitted latency ``alpha`` (s), inverse bandwidth ``beta`` (s/byte), and the RMS residual of the fit."""

    alpha: float
    beta: float
    residual: float
    relative: bool

    @property
    def bandwidth(self) -> float:
        """Bytes per second, ``1 / beta``."""
        return math.inf if self.beta <= 0 else 1.0 / self.beta


def fit(samples: Iterable[tuple[float, float]], algorithm: str = "ring", p: int = 2, relative: bool = False,
        **opts) -> Fit:
    """Least-squares ``(alpha, beta)`` from ``(nbytes, seconds)`` samples of ``algorithm`` at ``p`` ranks.

    The design columns are ``predict`` at ``(1, 0)`` and ``(0, 1)``, so any
    algorithm of :func:`predict` fits; ``opts`` go to it (``gamma`` is then
    held fixed). ``relative`` weighs each sample by
    ``1/seconds``, so a sweep from KiB to hundreds of MiB fits the latency
    as well as the bandwidth; the residual is then relative too. The fit is
    reported as it comes out: a negative alpha says the samples do not look
    like this model.
    """
    rows = [(float(n), float(t)) for n, t in samples]
    if len({n for n, _ in rows}) < 2:
        raise ValueError(f"fit needs samples at >= 2 distinct sizes; got sizes {sorted({n for n, _ in rows})}")
    if relative and any(t <= 0 for _, t in rows):
        raise ValueError("a relative fit needs every time > 0")
    xa, xb, y = [], [], []
    for n, t in rows:
        w = 1.0 / t if relative else 1.0
        # A given gamma is a fixed offset, not part of the columns.
        offset = predict(algorithm, n, p, 0.0, 0.0, **opts)
        xa.append((predict(algorithm, n, p, 1.0, 0.0, **opts) - offset) * w)
        xb.append((predict(algorithm, n, p, 0.0, 1.0, **opts) - offset) * w)
        y.append((t - offset) * w)
    saa, sbb, sab = sum(a * a for a in xa), sum(b * b for b in xb), sum(a * b for a, b in zip(xa, xb))
    say, sby = sum(a * v for a, v in zip(xa, y)), sum(b * v for b, v in zip(xb, y))
    det = saa * sbb - sab * sab
    if det <= 1e-12 * saa * sbb:
        raise ValueError(f"{algorithm} at p={p} cannot separate alpha from beta on these sizes")
    alpha = (say * sbb - sby * sab) / det
    beta = (sby * saa - say * sab) / det
    resid = math.sqrt(sum((v - alpha * a - beta * b) ** 2 for a, b, v in zip(xa, xb, y)) / len(y))
    return Fit(alpha, beta, resid, relative)


def size_range(lo: int = 1 << 10, hi: int = 256 << 20, factor: int = 2) -> list[int]:
    """Message sizes in bytes from ``lo`` to ``hi`` (inclusive), each ``factor`` times the last."""
    if lo < 4 or hi < lo or factor < 2:
        raise ValueError(f"size_range needs 4 <= lo <= hi and factor >= 2; got lo={lo}, hi={hi}, factor={factor}")
    out, n = [], lo
    while n <= hi:
        out.append(n)
        n *= factor
    return out
