"""Gradient codecs: average one flat fp32 bucket over a data-parallel group in fewer bytes.

A codec is stateful: the lossy ones keep an error-feedback residual (what
they failed to send, added to the next step's input), and PowerSGD keeps its
``Q`` matrices for warm starts. That state is per bucket (``bucket=`` in
:meth:`Codec.average`) and per rank, and comes out of :meth:`Codec.state_dict`
as a flat ``{name: tensor}`` dict so a training snapshot can carry it.

Bytes counted into :class:`CommStats` are the bytes this rank puts on the
wire for the collective as the backend runs it (ring all-reduce: ``2(p-1)/p``
of the buffer; ring all-gather: ``p-1`` copies of this rank's message;
all-to-all: the ``p-1`` parts meant for others). :func:`expected_bytes`
gives the same number without running anything.

With error feedback, ``sum_t decoded_t = sum_t true_avg_t - mean_r residual_r``:
what was not sent this step is owed, not lost, and the running sum of the
decoded averages tracks the running sum of the true ones.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .algorithms import ring_allreduce_bytes
from .stats import CommStats

CODECS = ("none", "fp16", "bf16", "int8", "topk", "powersgd")
Shapes = Sequence[tuple[int, Sequence[int]]]


def _size(group) -> int:
    return dist.get_world_size(dist.group.WORLD if group is None else group)


def _timed(stats: CommStats | None, op: str, nbytes: int, fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if stats is not None:
        stats.add(op, nbytes, time.perf_counter() - t0)
    return out


class Codec(ABC):
    """Base: per-bucket state as ``{"<kind>.<bucket>": tensor}``; subclasses define ``_average``."""

    name = ""
    options: tuple[str, ...] = ()
    state_kinds: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._state: dict[str, dict[int, torch.Tensor]] = {kind: {} for kind in self.state_kinds}

    def average(self, flat: torch.Tensor, group=None, stats: CommStats | None = None, *, bucket: int = 0,
                shapes: Shapes | None = None, step: int | None = None) -> None:
        """Replace ``flat`` (a 1-D fp32 bucket of this rank's gradients) with the decoded average over ``group``.

        ``bucket`` keys the per-bucket state; ``shapes`` lists ``(offset, shape)``
        of the parameters packed in ``flat`` (PowerSGD needs it, the others ignore it).
        ``step`` is the training step, which every rank agrees on; PowerSGD
        uses it (else its own per-bucket count) to decide when to compress,
        and ranks that disagree there would run different collectives.
        """
        if flat.dim() != 1 or flat.dtype != torch.float32:
            raise ValueError(f"{self.name} codec averages a 1-D float32 bucket; got a {flat.dim()}-D "
                             f"{flat.dtype} tensor of shape {tuple(flat.shape)}")
        p = _size(group)
        residual = self._state.get("residual", {}).get(bucket)
        if residual is not None and residual.numel() != flat.numel():
            raise ValueError(f"{self.name} codec state for bucket {bucket} holds {residual.numel()} elements but "
                             f"the bucket has {flat.numel()}: restore state saved with the same bucket layout, "
                             "or start from a fresh codec")
        if p == 1:
            # Alone, the average is exact: pay back anything still owed and stop.
            if residual is not None:
                flat.add_(residual)
                residual.zero_()
            return
        self._average(flat, group, stats, p, bucket, shapes, step)

    @abstractmethod
    def _average(self, flat, group, stats, p, bucket, shapes, step) -> None:
        """Average over ``p > 1`` ranks in place, counting into ``stats``."""

    @abstractmethod
    def expected_bytes(self, numel: int, p: int, shapes: Shapes | None = None) -> int:
        """Bytes one rank sends when this codec averages a bucket of ``numel`` elements over ``p`` ranks."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the per-bucket state, keyed ``"<kind>.<bucket>"`` (empty for stateless codecs)."""
        return {f"{kind}.{b}": t.detach().clone() for kind, per in self._state.items() for b, t in per.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace all state with ``state`` as returned by :meth:`state_dict` of the same codec."""
        fresh: dict[str, dict[int, torch.Tensor]] = {kind: {} for kind in self.state_kinds}
        for key, value in state.items():
            kind, _, bucket = key.rpartition(".")
            if kind not in fresh or not bucket.isdigit() or not isinstance(value, torch.Tensor):
                valid = ", ".join(f"'{k}.<bucket>'" for k in self.state_kinds) or "none"
                raise ValueError(f"{self.name} codec got state key {key!r} ({type(value).__name__}); "
                                 f"valid keys: {valid}")
            fresh[kind][int(bucket)] = value.detach().clone()
        self._state = fresh


class AllReduceCodec(Codec):
    """All-reduce in ``dtype``: fp32 (``none``), or fp16/bf16 at 2 bytes an element.

    Low precision divides by ``p`` before the sum, so the sum stays within
    fp16's 65504 wherever the gradients themselves do.
    """

    def __init__(self, name: str, dtype: torch.dtype):
        super().__init__()
        self.name, self.dtype = name, dtype

    def _average(self, flat, group, stats, p, bucket, shapes, step):
        low = flat if self.dtype == torch.float32 else flat.div(p).to(self.dtype)
        _timed(stats, "all_reduce", self.expected_bytes(flat.numel(), p), dist.all_reduce, low, group=group)
        if low is flat:
            flat.div_(p)
        else:
            flat.copy_(low)

    def expected_bytes(self, numel, p, shapes=None):
        return ring_allreduce_bytes(numel * self.dtype.itemsize, p) if p > 1 else 0


def _quantize_(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks ``v`` (rows, chunks, chunk) to int8 with one absmax scale per chunk: (int8 values,
    scales (rows, chunks)). ``v`` is left holding the rounding error, ``v - dequant``: the
    caller's error feedback, without another pass to compute it."""
    scales = v.abs().amax(dim=2, keepdim=True).div_(127.0)
    # An all-zero chunk has scale 0; dividing by 1 instead keeps it exactly 0.
    q = torch.div(v, torch.where(scales > 0, scales, 1.0)).round_().clamp_(-127, 127)
    v.addcmul_(q, scales, value=-1.0)
    return q.to(torch.int8), scales.squeeze(2)


def _pack(q: torch.Tensor, scales: torch.Tensor, part: int) -> torch.Tensor:
    """One uint8 row per part: its first ``part`` int8 values, then its fp32 scales' bytes
    (one message instead of two)."""
    return torch.cat([q.view(q.shape[0], -1)[:, :part].view(torch.uint8), scales.contiguous().view(torch.uint8)],
                     dim=1)


def _dequantize(packed: torch.Tensor, part: int, chunk: int) -> torch.Tensor:
    """Packed rows back to fp32, each padded to whole chunks (the padding is 0): (rows, chunks * chunk)."""
    rows = packed.shape[0]
    scales = packed[:, part:].contiguous().view(torch.float32)
    out = torch.zeros(rows, scales.shape[1] * chunk)
    out[:, :part].copy_(packed[:, :part].view(torch.int8))
    out.view(rows, -1, chunk).mul_(scales.unsqueeze(2))
    return out


class Int8Codec(Codec):
    """int8 with per-chunk absmax scales, reduce-scatter then all-gather, error feedback on both quantizations.

    The bucket is cut into ``p`` parts. An all-to-all hands each rank every
    rank's int8 copy of one part (with its scales); that owner dequantizes,
    averages, requantizes, and an all-gather returns the int8 parts. Every
    byte on the wire is int8 or a scale, so the bytes are ~1/4 of an fp32
    ring for any ``p`` (an int8 all-reduce would overflow its sums).

    Error feedback: each rank keeps ``input - dequant(quant(input))``; the
    owner also adds ``p *`` its requantization error on its part, because
    that error lands in the average, which is ``1/p`` of the sum of residuals.
    """

    name = "int8"
    options = ("chunk", "error_feedback")
    state_kinds = ("residual",)

    def __init__(self, chunk: int = 1024, error_feedback: bool = True):
        if chunk < 1:
            raise ValueError(f"int8 chunk must be >= 1 elements; got {chunk}")
        super().__init__()
        self.chunk, self.error_feedback = chunk, error_feedback

    def _layout(self, numel: int, p: int) -> tuple[int, int, int]:
        """(elements per part, scales per part, bytes per packed part)."""
        part = -(-numel // p)
        nch = -(-part // self.chunk)
        return part, nch, part + 4 * nch

    def _average(self, flat, group, stats, p, bucket, shapes, step):
        n = flat.numel()
        part, nch, width = self._layout(n, p)
        chunk = self.chunk
        owed = self._state["residual"].get(bucket) if self.error_feedback else None
        # Rank r's part is elements [r * part, (r + 1) * part), padded with zeros to whole chunks.
        v = torch.zeros(p, nch * chunk)
        rows = [(r, r * part, min(n, (r + 1) * part)) for r in range(p) if r * part < n]
        for r, lo, hi in rows:
            if owed is None:
                v[r, :hi - lo].copy_(flat[lo:hi])
            else:
                torch.add(flat[lo:hi], owed[lo:hi], out=v[r, :hi - lo])
        q, scales = _quantize_(v.view(p, nch, chunk))
        residual = torch.empty(n)
        for r, lo, hi in rows:
            residual[lo:hi].copy_(v[r, :hi - lo])
        recv = torch.empty(p, width, dtype=torch.uint8)
        _timed(stats, "all_to_all", (p - 1) * width, dist.all_to_all_single, recv, _pack(q, scales, part),
               group=group)
        # This rank now holds every rank's copy of its own part.
        avg = _dequantize(recv, part, chunk).sum(dim=0, keepdim=True).div_(p)
        q2, scales2 = _quantize_(avg.view(1, nch, chunk))  # avg now holds its rounding error
        me = dist.get_rank(group)
        lo, hi = me * part, min((me + 1) * part, n)
        if hi > lo:
            # That error lands in the average, 1/p of the residuals' sum: this rank owes p times it.
            residual[lo:hi].add_(avg[0, :hi - lo], alpha=p)
        mine = _pack(q2, scales2, part).view(-1)
        gathered = [torch.empty_like(mine) for _ in range(p)]
        _timed(stats, "all_gather", (p - 1) * width, dist.all_gather, gathered, mine, group=group)
        out = _dequantize(torch.stack(gathered), part, chunk)
        for r, lo, hi in rows:
            flat[lo:hi].copy_(out[r, :hi - lo])
        if self.error_feedback:
            self._state["residual"][bucket] = residual

    def expected_bytes(self, numel, p, shapes=None):
        return 2 * (p - 1) * self._layout(numel, p)[2] if p > 1 else 0


class TopKCodec(Codec):
    """Each rank sends its ``ratio * N`` largest-magnitude entries (values + int32 indices) by all-gather.

    Error feedback keeps everything not sent; with ``value_dtype=float16`` it
    also keeps the rounding of the sent values (clamped to fp16's range).
    """

    name = "topk"
    options = ("ratio", "value_dtype", "error_feedback", "warmup_steps")
    state_kinds = ("residual",)
    # Where a sparsity warm-up starts: a quarter of the entries (DGC's 75% sparsity).
    WARMUP_START = 0.25

    def __init__(self, ratio: float = 0.01, value_dtype: torch.dtype | str = torch.float32,
                 error_feedback: bool = True, warmup_steps: int = 0):
        if not 0 < ratio <= 1:
            raise ValueError(f"topk ratio must be in (0, 1]; got {ratio}")
        if warmup_steps < 0:
            raise ValueError(f"topk warmup_steps must be >= 0; got {warmup_steps}")
        dtypes = {"float32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
        value_dtype = dtypes.get(value_dtype, value_dtype) if isinstance(value_dtype, str) else value_dtype
        if value_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"topk value_dtype must be float32 or float16; got {value_dtype}")
        super().__init__()
        self.ratio, self.value_dtype, self.error_feedback = ratio, value_dtype, error_feedback
        self.warmup_steps = warmup_steps

    def ratio_at(self, step: int | None) -> float:
        """Share sent in ``step`` (counted from 1): during the warm-up it falls geometrically
        from ``WARMUP_START`` to ``ratio``; after it (or with no step given) it is ``ratio``."""
        start = max(self.ratio, self.WARMUP_START)
        if step is None or not self.warmup_steps or step > self.warmup_steps:
            return self.ratio
        frac = (step - 1) / self.warmup_steps
        return start * (self.ratio / start) ** frac

    def k(self, numel: int, step: int | None = None) -> int:
        """How many entries a rank sends for a bucket of ``numel`` (in ``step``, for the warm-up)."""
        return min(numel, max(1, math.ceil(self.ratio_at(step) * numel)))

    def _message_bytes(self, numel: int, step: int | None = None) -> int:
        return self.k(numel, step) * (torch.finfo(self.value_dtype).bits // 8 + 4)

    def _average(self, flat, group, stats, p, bucket, shapes, step):
        x = flat.clone()
        if self.error_feedback and bucket in self._state["residual"]:
            x.add_(self._state["residual"][bucket])
        k = self.k(x.numel(), step)
        idx = x.abs().topk(k, sorted=False).indices
        vals = x[idx]
        if self.value_dtype == torch.float16:
            vals = vals.clamp(-65504.0, 65504.0)
        sent = vals.to(self.value_dtype)
        # Indices first: the 4-byte ones stay aligned whatever k and the value width are.
        message = torch.cat([idx.to(torch.int32).view(torch.uint8), sent.view(torch.uint8)])
        gathered = [torch.empty_like(message) for _ in range(p)]
        _timed(stats, "all_gather", (p - 1) * message.numel(), dist.all_gather, gathered, message, group=group)
        flat.zero_()
        for m in gathered:
            flat.index_add_(0, m[:4 * k].view(torch.int32).long(), m[4 * k:].view(self.value_dtype).float())
        flat.div_(p)
        if self.error_feedback:
            x[idx] -= sent.float()
            self._state["residual"][bucket] = x

    def expected_bytes(self, numel, p, shapes=None, step=None):
        """Bytes one rank sends; in ``step`` if given (the warm-up sends more), else steady state."""
        return (p - 1) * self._message_bytes(numel, step) if p > 1 else 0


def _orthogonalize(m: torch.Tensor) -> None:
    """Orthonormal columns in place (Householder QR: a zero column stays finite, unlike Gram-Schmidt)."""
    m.copy_(torch.linalg.qr(m).Q)


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

    def __init__(self, rank: int = 4, start_step: int = 0, min_compression_rate: float = 2.0,
                 warm_start: bool = True, error_feedback: bool = True, seed: int = 0):
        if rank < 1 or start_step < 0:
            raise ValueError(f"powersgd needs rank >= 1 and start_step >= 0; got rank={rank}, start_step={start_step}")
        super().__init__()
        self.rank, self.start_step, self.min_compression_rate = rank, start_step, min_compression_rate
        self.warm_start, self.error_feedback, self.seed = warm_start, error_feedback, seed

    def _plan(self, numel: int, shapes: Shapes | None) -> tuple[list[tuple[int, int, int, int]], torch.Tensor]:
        """([(offset, n, m, r)] of the matrices to compress, indices of every other element)."""
        if shapes is None:
            raise ValueError("powersgd needs the bucket's parameter shapes: pass shapes=[(offset, shape), ...]")
        matrices, end = [], 0
        keep = torch.ones(numel, dtype=torch.bool)
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
                keep[offset:end] = False
        return matrices, keep.nonzero().view(-1)

    def _average(self, flat, group, stats, p, bucket, shapes, step):
        matrices, rest = self._plan(flat.numel(), shapes)
        count = int(self._state["step"].get(bucket, torch.tensor(0)))
        self._state["step"][bucket] = torch.tensor(count + 1)
        step = count if step is None else step
        if step < self.start_step:
            _timed(stats, "all_reduce", ring_allreduce_bytes(flat.numel() * 4, p), dist.all_reduce, flat, group=group)
            flat.div_(p)
            return
        if self.error_feedback and bucket in self._state["residual"]:
            flat.add_(self._state["residual"][bucket])
        x = flat.clone() if self.error_feedback else None
        n_p, n_q = sum(n * r for _, n, _, r in matrices), sum(m * r for _, _, m, r in matrices)
        q_all = self._state["q"].get(bucket)
        if not (self.warm_start and q_all is not None and q_all.numel() == n_q):
            # Every rank draws the same Q: the seed depends only on what all ranks agree on.
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + bucket * 7919 + step)
            q_all = torch.randn(n_q, generator=gen)
        # The uncompressed elements ride in the same all-reduce as P.
        first = torch.empty(rest.numel() + n_p)
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
            _timed(stats, "all_reduce", ring_allreduce_bytes(first.numel() * 4, p), dist.all_reduce, first,
                   group=group)
        flat[rest] = first[:rest.numel()] / p
        if matrices:
            for mat, pm, qm in zip(ms, ps, qs):
                # P is a sum, not an average: orthogonalizing removes the scale anyway.
                _orthogonalize(pm)
                torch.matmul(mat.T, pm, out=qm)
            _timed(stats, "all_reduce", ring_allreduce_bytes(n_q * 4, p), dist.all_reduce, q_all, group=group)
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
        matrices, rest = self._plan(numel, shapes)
        n_p, n_q = sum(n * r for _, n, _, r in matrices), sum(m * r for _, _, m, r in matrices)
        return ring_allreduce_bytes((rest.numel() + n_p) * 4, p) + ring_allreduce_bytes(n_q * 4, p)


_FACTORIES = {
    "none": (lambda: AllReduceCodec("none", torch.float32), ()),
    "fp16": (lambda: AllReduceCodec("fp16", torch.float16), ()),
    "bf16": (lambda: AllReduceCodec("bf16", torch.bfloat16), ()),
    "int8": (Int8Codec, Int8Codec.options),
    "topk": (TopKCodec, TopKCodec.options),
    "powersgd": (PowerSGDCodec, PowerSGDCodec.options),
}


def make_codec(name: str, **opts) -> Codec:
    """A fresh codec called ``name`` (one of :data:`CODECS`), e.g. ``make_codec("topk", ratio=0.01)``."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown gradient codec {name!r}; valid: {', '.join(CODECS)}")
    factory, options = _FACTORIES[name]
    unknown = sorted(set(opts) - set(options))
    if unknown:
        raise ValueError(f"codec {name!r} takes options ({', '.join(options) or 'none'}); "
                         f"got unknown {', '.join(unknown)}")
    return factory(**opts)


def expected_bytes(name: str, numel: int, p: int, shapes: Shapes | None = None, **opts) -> int:
    """Bytes one rank sends when codec ``name`` averages a bucket of ``numel`` fp32 elements over ``p`` ranks.

    ``opts`` are the codec's options; for ``powersgd`` and ``topk`` also
    ``step``, the bucket's step count at the call (default: the steady state,
    past PowerSGD's ``start_step`` and top-k's warm-up).
    """
    if p < 1 or numel < 0:
        raise ValueError(f"expected_bytes needs p >= 1 and numel >= 0; got p={p}, numel={numel}")
    if name in ("powersgd", "topk") and "step" in opts:
        step = opts.pop("step")
        return make_codec(name, **opts).expected_bytes(numel, p, shapes, step=step)
    return make_codec(name, **opts).expected_bytes(numel, p, shapes)
