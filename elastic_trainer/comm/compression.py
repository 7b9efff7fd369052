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

import torch
import torch.distributed as dist

from .algorithms import ring_allreduce_bytes
from .codec import Codec, Shapes, timed
from .powersgd import PowerSGDCodec
from .sparse_reduce import sparse_allreduce, sparse_reduce_bytes

CODECS = ("none", "fp16", "bf16", "int8", "topk", "powersgd")


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
        timed(stats, "all_reduce", self.expected_bytes(flat.numel(), p), flat.device, dist.all_reduce, low,
              group=group)
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
    out = torch.zeros(rows, scales.shape[1] * chunk, device=packed.device)
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
        v = torch.zeros(p, nch * chunk, device=flat.device)
        rows = [(r, r * part, min(n, (r + 1) * part)) for r in range(p) if r * part < n]
        for r, lo, hi in rows:
            if owed is None:
                v[r, :hi - lo].copy_(flat[lo:hi])
            else:
                torch.add(flat[lo:hi], owed[lo:hi], out=v[r, :hi - lo])
        q, scales = _quantize_(v.view(p, nch, chunk))
        residual = torch.empty(n, device=flat.device)
        for r, lo, hi in rows:
            residual[lo:hi].copy_(v[r, :hi - lo])
        recv = torch.empty(p, width, dtype=torch.uint8, device=flat.device)
        timed(stats, "all_to_all", (p - 1) * width, flat.device, dist.all_to_all_single, recv,
              _pack(q, scales, part), group=group)
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
        timed(stats, "all_gather", (p - 1) * width, flat.device, dist.all_gather, gathered, mine, group=group)
        out = _dequantize(torch.stack(gathered), part, chunk)
        for r, lo, hi in rows:
            flat[lo:hi].copy_(out[r, :hi - lo])
        if self.error_feedback:
            self._state["residual"][bucket] = residual

    def expected_bytes(self, numel, p, shapes=None):
        return 2 * (p - 1) * self._layout(numel, p)[2] if p > 1 else 0


class TopKCodec(Codec):
    """Each rank sends its ``ratio * N`` largest-magnitude entries (values + int32 indices).

    ``exchange="allgather"``: by all-gather, so a rank sends and receives
    ``(p - 1) k`` pairs. ``exchange="sparse_reduce"``: scattered by index range,
    summed by the range's owner, re-sparsified to ``k`` and all-gathered
    (``comm.sparse_reduce``): about ``2k`` pairs at any ``p``.

    Error feedback keeps everything not sent (and, with ``sparse_reduce``, what
    the owner's re-sparsify dropped); with ``value_dtype=float16`` it also keeps
    the rounding of the sent values (clamped to fp16's range).
    """

    name = "topk"
    options = ("ratio", "value_dtype", "error_feedback", "warmup_steps", "exchange")
    EXCHANGES = ("allgather", "sparse_reduce")
    state_kinds = ("residual",)
    # Where a sparsity warm-up starts: a quarter of the entries (DGC's 75% sparsity).
    WARMUP_START = 0.25

    def __init__(self, ratio: float = 0.01, value_dtype: torch.dtype | str = torch.float32,
                 error_feedback: bool = True, warmup_steps: int = 0, exchange: str = "allgather"):
        if not 0 < ratio <= 1:
            raise ValueError(f"topk ratio must be in (0, 1]; got {ratio}")
        if exchange not in self.EXCHANGES:
            raise ValueError(f"topk exchange must be one of {', '.join(self.EXCHANGES)}; got {exchange!r}")
        if warmup_steps < 0:
            raise ValueError(f"topk warmup_steps must be >= 0; got {warmup_steps}")
        dtypes = {"float32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
        value_dtype = dtypes.get(value_dtype, value_dtype) if isinstance(value_dtype, str) else value_dtype
        if value_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"topk value_dtype must be float32 or float16; got {value_dtype}")
        super().__init__()
        self.ratio, self.value_dtype, self.error_feedback = ratio, value_dtype, error_feedback
        self.warmup_steps, self.exchange = warmup_steps, exchange

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
        if self.exchange == "sparse_reduce":
            avg, residual = sparse_allreduce(x, k, group, p, dist.get_rank(group), stats, self.value_dtype)
            flat.copy_(avg)
            if self.error_feedback:
                self._state["residual"][bucket] = residual
            return
        idx = x.abs().topk(k, sorted=False).indices
        vals = x[idx]
        if self.value_dtype == torch.float16:
            vals = vals.clamp(-65504.0, 65504.0)
        sent = vals.to(self.value_dtype)
        # Indices first: the 4-byte ones stay aligned whatever k and the value width are.
        message = torch.cat([idx.to(torch.int32).view(torch.uint8), sent.view(torch.uint8)])
        gathered = [torch.empty_like(message) for _ in range(p)]
        timed(stats, "all_gather", (p - 1) * message.numel(), flat.device, dist.all_gather, gathered, message,
              group=group)
        flat.zero_()
        for m in gathered:
            flat.index_add_(0, m[:4 * k].view(torch.int32).long(), m[4 * k:].view(self.value_dtype).float())
        flat.div_(p)
        if self.error_feedback:
            x[idx] -= sent.float()
            self._state["residual"][bucket] = x

    def expected_bytes(self, numel, p, shapes=None, step=None):
        """Bytes one rank sends; in ``step`` if given (the warm-up sends more), else steady state."""
        if p < 2:
            return 0
        if self.exchange == "sparse_reduce":
            return sparse_reduce_bytes(numel, p, self.k(numel, step), torch.finfo(self.value_dtype).bits // 8)
        return (p - 1) * self._message_bytes(numel, step)


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
