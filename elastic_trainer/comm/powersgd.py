"""PowerSGD: low-rank gradient averaging with error feedback and warm-started power iteration."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .algorithms import ring_allreduce_bytes
from .codec import Codec, Shapes, timed


def _orthogonalize(m: torch.Tensor) -> None:
    """Orthonormal columns in place (Householder QR: a zero column stays finite, unlike Gram-Schmidt)."""
    m.copy_(torch.linalg.qr(m).Q)


def initial_q(n: int, seed: int) -> torch.Tensor:
    """The cold-start ``Q`` (``n`` values): every rank draws the same one, since the seed depends
    only on what all ranks agree on. It is drawn on the host on purpose, so a codec on any device
    starts from the Q the CPU does (device generators draw other numbers)."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


class PowerSGDCodec(Codec):
    """Rank-``rank`` PowerSGD (Vogels et al. 2019), after torch's ``powerSGD_hook``.

    Each 2-D+ parameter (viewed as ``shape[0] x rest``) worth compressing
    (``(n + m) * r * min_compression_rate < n * m``) is sent as ``P = M Q``
    then ``Q = M^T P``; everything else (biases, norms) is all-reduced in fp32
    in the same message as ``P``, one collective fewer than torch's hook.
    Steps before ``start_step`` (counted per bucket) are a plain all-reduce.
    With ``warm_start`` the averaged ``Q`` seeds the next step's power iteration.

    Error feedback keeps ``input - decoded`` on the compressed entries only;
    torch also keeps ``x_r - mean(x)`` on the uncompressed ones, which
    averages to zero and only lets each rank's copy drift.
    """

    name = "powersgd"
    options = ("rank", "start_step", "min_compression_rate", "warm_start", "error_feedback", "seed")
    state_kinds = ("residual", "q", "step")
    device_kinds = ("residual", "q")  # "step" is a host-side count

    def __init__(self, rank: int = 4, start_step: int = 0, min_compression_rate: float = 2.0,
                 warm_start: bool = True, error_feedback: bool = True, seed: int = 0):
        if rank < 1 or start_step < 0:
            raise ValueError(f"powersgd needs rank >= 1 and start_step >= 0; got rank={rank}, start_step={start_step}")
        super().__init__()
        self.rank, self.start_step, self.min_compression_rate = rank, start_step, min_compression_rate
        self.warm_start, self.error_feedback, self.seed = warm_start, error_feedback, seed
        self._plans: dict = {}  # (numel, shapes, device) -> _plan's answer, which depends on nothing else

    def _plan(self, numel: int, shapes: Shapes | None) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]]:
        """([(offset, n, m, r)] of the matrices to compress, [(lo, hi)] ranges of every other element)."""
        if shapes is None:
            raise ValueError("powersgd needs the bucket's parameter shapes: pass shapes=[(offset, shape), ...]")
        matrices, end = [], 0
        for offset, shape in sorted((int(o), tuple(int(d) for d in s)) for o, s in shapes):
            size = math.prod(shape)
            if offset < end or offset + size > numel:
                raise ValueError(f"parameter at offset {offset} with shape {shape} overlaps another or runs "
                                 f"past the bucket's {numel} elements")
            end = offset + size
            n, m = (shape[0], size // shape[0]) if len(shape) >= 2 else (size, 1)
            r = min(n, m, self.rank)
            if len(shape) >= 2 and (n + m) * r * self.min_compression_rate < n * m:
                matrices.append((offset, n, m, r))
        rest, at = [], 0
        for offset, n, m, _ in matrices:
            if offset > at:
                rest.append((at, offset))
            at = offset + n * m
        if numel > at:
            rest.append((at, numel))
        return matrices, rest

    def _plan_on(self, numel: int, shapes: Shapes | None, device: torch.device):
        """:meth:`_plan` with the uncompressed elements' indices as a tensor on ``device``, made once
        per bucket layout (on the device itself: no host mask to copy over every step)."""
        key = (numel, None if shapes is None else tuple((int(o), tuple(s)) for o, s in shapes), str(device))
        if key not in self._plans:
            matrices, ranges = self._plan(numel, shapes)
            parts = [torch.arange(lo, hi, device=device) for lo, hi in ranges]
            rest = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)
            self._plans[key] = (matrices, rest)
        return self._plans[key]

    def _average(self, flat, group, stats, p, bucket, shapes, step):
        dev = flat.device
        matrices, rest = self._plan_on(flat.numel(), shapes, dev)
        count = int(self._state["step"].get(bucket, torch.tensor(0)))
        self._state["step"][bucket] = torch.tensor(count + 1)
        step = count if step is None else step
        if step < self.start_step:
            timed(stats, "all_reduce", ring_allreduce_bytes(flat.numel() * 4, p), dev, dist.all_reduce, flat,
                  group=group)
            flat.div_(p)
            return
        if self.error_feedback and bucket in self._state["residual"]:
            flat.add_(self._state["residual"][bucket])
        x = flat.clone() if self.error_feedback else None
        n_p, n_q = sum(n * r for _, n, _, r in matrices), sum(m * r for _, _, m, r in matrices)
        q_all = self._state["q"].get(bucket)
        if not (self.warm_start and q_all is not None and q_all.numel() == n_q):
            q_all = initial_q(n_q, self.seed * 1_000_003 + bucket * 7919 + step).to(dev)
        # The uncompressed elements ride in the same all-reduce as P.
        first = torch.empty(rest.numel() + n_p, device=dev)
        first[:rest.numel()] = flat[rest]
        ms, ps, qs, at, qat = [], [], [], rest.numel(), 0
        for offset, n, m, r in matrices:
            ms.append(flat[offset:offset + n * m].view(n, m))
            ps.append(first[at:at + n * r].view(n, r))
            qs.append(q_all[qat:qat + m * r].view(m, r))
            at, qat = at + n * r, qat + m * r
        for mat, pm, qm in zip(ms, ps, qs):
            _orthogonalize(qm)
            torch.matmul(mat, qm, out=pm)
        if first.numel():
            timed(stats, "all_reduce", ring_allreduce_bytes(first.numel() * 4, p), dev, dist.all_reduce, first,
                  group=group)
        flat[rest] = first[:rest.numel()] / p
        if matrices:
            for mat, pm, qm in zip(ms, ps, qs):
                # P is a sum, not an average: orthogonalizing removes the scale anyway.
                _orthogonalize(pm)
                torch.matmul(mat.T, pm, out=qm)
            timed(stats, "all_reduce", ring_allreduce_bytes(n_q * 4, p), dev, dist.all_reduce, q_all, group=group)
            q_all.div_(p)
            for mat, pm, qm in zip(ms, ps, qs):
                torch.matmul(pm, qm.T, out=mat)
        if self.warm_start:
            self._state["q"][bucket] = q_all
        if x is not None:
            residual = x.sub_(flat)
            residual[rest] = 0
            self._state["residual"][bucket] = residual

    def expected_bytes(self, numel, p, shapes=None, step=None):
        """Bytes per rank; ``step`` is the bucket's step at the call (``None``: one past ``start_step``)."""
        if p == 1:
            return 0
        if step is not None and step < self.start_step:
            return ring_allreduce_bytes(numel * 4, p)
        matrices, ranges = self._plan(numel, shapes)
        n_p, n_q = sum(n * r for _, n, _, r in matrices), sum(m * r for _, _, m, r in matrices)
        n_rest = sum(hi - lo for lo, hi in ranges)
        return ring_allreduce_bytes((n_rest + n_p) * 4, p) + ring_allreduce_bytes(n_q * 4, p)
