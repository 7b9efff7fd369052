"""Data-parallel gradient averaging: bucketed, overlapped with backward, compressed.

All gradient traffic of ``comm.sync: allreduce`` goes through :class:`GradSync`.
Parameters are grouped into buckets in reverse order (the order backward
produces their gradients). With ``comm.overlap`` a post-accumulate hook counts
each parameter's accumulations; once every parameter of a bucket has had its
last micro-batch's gradient, the bucket is copied out and handed to a comm
thread, which averages it (codec + algorithm) while backward carries on with
the next buckets. ``finish`` waits for the rest; that wait is the step's
*exposed* communication.

Buckets are averaged strictly in index order, so every replica runs the same
sequence of collectives whatever the timing of its hooks.

On CUDA the comm thread queues its work on a stream of its own, so the
all-reduce runs beside backward's kernels instead of behind them on the
compute stream. Events order the two: a bucket's averaging waits for the
event recorded after its gradients were copied out, and the compute stream
waits for the event recorded after the last bucket before the averages are
written into ``.grad``. The exposed communication is then the compute
stream's stall at that wait, timed by CUDA events (``comm.timing``).

Sharded (``parallel.shard_optimizer``, given an ``exchange``): each bucket is
reduce-scattered instead, padded to a multiple of the group size, and the
rank keeps the average of the shard it owns (``shard_grads``,
``parallel.shard_ranges``); ``.grad`` is not written back. With ``free_grads``
(ZeRO-2) a bucket's ``.grad`` tensors are let go as soon as they are copied
out. Parameters named in ``hold`` (tied across stages, whose gradients are
summed before they are averaged) go in buckets of their own, last, sent once
``finish`` has run its ``before_held``.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ..config import CommSection
from ..parallel.shard_ranges import shard_len
from .algorithms import get_algorithm
from .comm_thread import CommThread
from .buckets import make_buckets
from .stats import CommStats
from .compression import make_codec
from .timing import start_timer
from .host import host_array
from .shard_exchange import ShardExchange

# Own algorithms replace the all-reduce inside these codecs; the others are built
# from all-to-all / all-gather and keep the backend's.
_ALLREDUCE_CODECS = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_SENT = torch.empty(0)   # a sharded bucket reduce-scattered: its copy let go


def codec_options(comm: CommSection, seed: int) -> dict:
    if comm.compression == "topk":
        return {"ratio": comm.topk_ratio, "warmup_steps": comm.topk_warmup_steps, "exchange": comm.topk_exchange}
    if comm.compression == "powersgd":
        return {"rank": comm.powersgd_rank, "start_step": comm.powersgd_start_step, "seed": seed}
    return {}


class _Bucket:
    def __init__(self, index: int, named: list[tuple[str, torch.nn.Parameter]], held: bool = False):
        self.index, self.held = index, held
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes, offset = [], 0
        for p in self.params:
            self.shapes.append((offset, tuple(p.shape)))
            offset += p.numel()
        self.numel = offset


class GradSync:
    """Averages one rank's gradients over its DP group (``group_size`` ranks).

    ``accumulations``: backward passes per step that add into each gradient
    (the micro-batches); ``grad_scale`` multiplies the averaged gradients (1 /
    micro-batches where the loss was not already divided by them).
    """

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], group, group_size: int,
                 comm: CommSection, accumulations: int, grad_scale: float = 1.0, seed: int = 0,
                 exchange: ShardExchange | None = None, free_grads: bool = False, hold: set[str] = frozenset()):
        self.group, self.p, self.comm = group, group_size, comm
        self.accumulations, self.grad_scale = accumulations, grad_scale
        self.exchange, self.free_grads = exchange, free_grads and exchange is not None
        by_id = {id(p): n for n, p in named_params}
        size = int(comm.bucket_mb * (1 << 20))
        hold = hold if exchange is not None else frozenset()
        first = make_buckets([p for n, p in named_params if n not in hold], size)
        last = make_buckets([p for n, p in named_params if n in hold], size)
        self.buckets = [_Bucket(i, [(by_id[id(p)], p) for p in b], held=i >= len(first))
                        for i, b in enumerate(first + last)]
        self.shard_grads: dict[int, torch.Tensor] = {}   # sharded: bucket -> the averaged shard this rank owns
        self._worker: CommThread | None = None   # the comm thread, kept from step to step (comm_thread.py)
        # Made once, here, and written every step: made by the comm thread each step, they grew the
        # process by a gradient's size a step (glibc keeps a thread's freed memory in its own arena).
        dtype = _ALLREDUCE_CODECS.get(comm.compression, torch.float32)
        self._shard_out = {b.index: torch.empty(shard_len(b.numel, group_size), dtype=dtype, device=b.params[0].device)
                           for b in self.buckets} if exchange is not None else {}
        self._shard_fp32 = ({i: t if t.dtype == torch.float32 else torch.empty(t.numel(), device=t.device)
                             for i, t in self._shard_out.items()})
        self.codec = make_codec(comm.compression, **codec_options(comm, seed))
        self.algorithm = get_algorithm(comm.algorithm) if comm.algorithm != "ring" else None
        self.overlap = comm.overlap and group_size > 1
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for b in self.buckets for p in b.params] if self.overlap else []
        self.device = named_params[0][1].device if named_params else torch.device("cpu")
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda and self.overlap else None
        self._reset_step(0)

    # -- per step -----------------------------------------------------------------
    def _reset_step(self, step: int) -> None:
        self._step = step
        self._counts = {b.index: 0 for b in self.buckets}
        self._flats: dict[int, torch.Tensor] = {}
        self._copied: dict[int, object] = {}  # bucket -> CUDA event after its copy (comm stream only)
        self._done = None                     # CUDA event after the comm stream's last bucket
        self._ready = {b.index: threading.Event() for b in self.buckets}
        self._error: BaseException | None = None
        self._job: threading.Event | None = None   # set when this step's exchanges are done (overlap)
        self._stats = CommStats()
        self.shard_grads = {}

    def begin_step(self, step: int) -> None:
        """Arm the hooks for ``step``; with overlap, start the comm thread."""
        self.abort()
        self._reset_step(step)
        if self.overlap:
            if self._worker is None or not self._worker.idle:
                if self._worker is not None:
                    self._worker.retire()   # stuck in an aborted step's collective: left to end on its own
                self._worker = CommThread("grad-sync")
            self._job = self._worker.submit(self._comm_loop)

    def _on_grad(self, p: torch.Tensor) -> None:
        b = self._bucket_of[id(p)]
        self._counts[b.index] += 1
        if self._counts[b.index] == len(b.params) * self.accumulations and not b.held:
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        # Copied now, in the backward thread: the comm thread must not see grads
        # that later code (a schedule's scaling, the optimizer) may change.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        parts = [g.detach().reshape(-1).float() for g in grads]
        if self.exchange is not None:
            pad = shard_len(b.numel, self.p) * self.p - b.numel
            if pad:
                parts.append(torch.zeros(pad, device=parts[0].device))
        self._flats[b.index] = torch.cat(parts)
        if self.free_grads:
            for p in b.params:
                p.grad = None   # ZeRO-2: the bucket's copy is all that is left of them
        if self._stream is not None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))  # the stream backward copied it on
            self._copied[b.index] = ev
        self._ready[b.index].set()

    def _comm_loop(self) -> None:
        try:
            if self._stream is None:
                self._average_all()
                return
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                self._average_all()
                done = torch.cuda.Event()
                done.record(self._stream)
                self._done = done
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by finish()
            self._error = e

    def _average_all(self) -> None:
        for b in self.buckets:
            self._ready[b.index].wait()
            if self._error is not None or b.index not in self._flats:
                return  # aborted
            flat = self._flats[b.index]
            if self._stream is not None:
                self._stream.wait_event(self._copied[b.index])
                flat.record_stream(self._stream)  # made on the compute stream, used on this one
            self._average(b, flat, self._stats)

    def _average(self, b: _Bucket, flat: torch.Tensor, stats: CommStats) -> None:
        if self.exchange is not None:
            dtype = _ALLREDUCE_CODECS[self.comm.compression]
            low = flat.div(self.p).to(dtype) if dtype != torch.float32 else flat
            out = self._shard_out[b.index]
            self.exchange.reduce_scatter(low, out, stats)
            shard = self._shard_fp32[b.index]
            if dtype != torch.float32:
                shard.copy_(out)
            else:
                shard.div_(self.p)
            if self.grad_scale != 1.0:
                shard.mul_(self.grad_scale)
            self.shard_grads[b.index] = shard
            self._flats[b.index] = _SENT   # the bucket's copy goes now: its shard is all that is kept
            return
        if self.algorithm is not None and self.comm.compression in _ALLREDUCE_CODECS:
            dtype = _ALLREDUCE_CODECS[self.comm.compression]
            low = flat.div(self.p).to(dtype) if dtype != torch.float32 else flat
            self.algorithm(low, self.group, stats)
            if low is flat:
                flat.div_(self.p)
            else:
                flat.copy_(low)
        else:
            self.codec.average(flat, self.group, stats, bucket=b.index, shapes=b.shapes, step=self._step)

    def finish(self, stats: CommStats, before_held=None):
        """Average whatever backward has not handed over yet, wait for the comm thread,
        write the averages into ``.grad`` (sharded: into ``shard_grads``); returns a stopped
        timer of that wait (exposed comm: on CUDA the compute stream's stall, read with
        ``.seconds()`` once the step's work is done). ``before_held``: run before the held
        buckets are sent (the tied gradients' sum)."""
        timer = start_timer(self.device)
        if before_held is not None:
            before_held()
        if self.p > 1:
            for b in self.buckets:
                if b.index not in self._flats:  # no hook (overlap off), or a parameter got no gradient
                    self._launch(b)
            if self._job is not None:
                self._job.wait()
                self._job = None
            else:
                for b in self.buckets:
                    self._average(b, self._flats[b.index], self._stats)
            if self._error is not None:
                raise self._error
            if self._done is not None:
                torch.cuda.current_stream(self.device).wait_event(self._done)
        timer.stop()
        stats.merge(self._stats)
        if self.exchange is not None:
            self._flats = {}
            return timer
        for b in self.buckets:
            flat = self._flats.get(b.index)
            for p, (offset, shape) in zip(b.params, b.shapes):
                if flat is None:  # alone: the gradient is already the average
                    if p.grad is not None and self.grad_scale != 1.0:
                        p.grad.mul_(self.grad_scale)
                    continue
                avg = flat[offset:offset + p.numel()].view(shape)
                if self.grad_scale != 1.0:
                    avg = avg * self.grad_scale
                if p.grad is None:
                    p.grad = avg.to(p.dtype).clone()
                else:
                    p.grad.copy_(avg)
        self._flats = {}
        return timer

    def abort(self) -> None:
        """Stop a step's comm thread (the step failed): it must not hold the groups."""
        if self._job is not None:
            self._error = self._error or RuntimeError("step aborted")
            for ev in self._ready.values():
                ev.set()
            self._job.wait(timeout=0.1)
            self._job = None

    def close(self) -> None:
        self.abort()
        if self._worker is not None:
            self._worker.retire()
            self._worker = None
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- state carried by snapshots ----------------------------------------------
    def export_state(self) -> dict:
        """Codec state by parameter name (error-feedback residuals) plus per-bucket extras
        (PowerSGD's Q), as numpy; the replica it belongs to is recorded by the caller."""
        state = self.codec.state_dict()
        out: dict = {"codec": self.comm.compression, "residual": {}, "buckets": {}}
        for b in self.buckets:
            res = state.get(f"residual.{b.index}")
            if res is not None:
                for name, p, (offset, _) in zip(b.names, b.params, b.shapes):
                    out["residual"][name] = host_array(res[offset:offset + p.numel()])
            extras = {k.rpartition(".")[0]: host_array(v) for k, v in state.items()
                      if k.endswith(f".{b.index}") and not k.startswith("residual.")}
            if extras:
                out["buckets"][",".join(b.names)] = extras
        return out

    def load_state(self, saved: dict | None, names: set[str]) -> int:
        """Restore residuals for the parameters in ``names`` (others start at zero) and the
        per-bucket extras of buckets with the same parameters. Returns residuals restored."""
        if not saved or saved.get("codec") != self.comm.compression:
            return 0
        state, restored = {}, 0
        for b in self.buckets:
            if any(n in saved["residual"] for n in b.names):
                # On the host: the codec moves it to the bucket's device where it runs (its
                # own stream), so no compute-stream block is freed under the comm stream.
                res = torch.zeros(b.numel)
                for name, p, (offset, _) in zip(b.names, b.params, b.shapes):
                    if name in names and name in saved["residual"]:
                        res[offset:offset + p.numel()] = torch.from_numpy(np.array(saved["residual"][name]))
                        restored += 1
                state[f"residual.{b.index}"] = res
            for kind, value in saved["buckets"].get(",".join(b.names), {}).items():
                state[f"{kind}.{b.index}"] = torch.from_numpy(np.array(value))
        self.codec.load_state_dict(state)
        return restored
