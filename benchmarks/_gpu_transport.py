"""Ranks on one GPU: gloo moves CUDA tensors only in all-reduce and broadcast, so the rest go through the host.

NCCL refuses two ranks on one device, so where the GPU check runs more ranks
than there are GPUs it uses gloo. gloo's own CUDA support covers all-reduce
and broadcast; every other op a codec, an algorithm or a pipeline uses
(all-to-all, all-gather, send/recv, batched p2p) is staged here: CUDA
tensors are copied to the host, moved by gloo, and copied back. The code under
check runs on CUDA either way; only the wire is the host's. Installed in the
check's worker processes only, never by the product.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_ORIG: dict = {}


def _is_cuda(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cuda


class _StagedWork:
    """A host work whose wait() also copies what it received back onto the device."""

    def __init__(self, work, copies: list[tuple[torch.Tensor, torch.Tensor]]):
        self.work, self.copies = work, copies

    def wait(self, timeout=None):
        if self.work is not None:
            self.work.wait() if timeout is None else self.work.wait(timeout)
        for device_t, host_t in self.copies:
            device_t.copy_(host_t)
        self.copies = []
        return True

    def is_completed(self):
        return self.work is None or self.work.is_completed()


def _all_to_all_single(output, input, *args, **kwargs):
    if not (_is_cuda(output) or _is_cuda(input)):
        return _ORIG["all_to_all_single"](output, input, *args, **kwargs)
    host_out = torch.empty(output.shape, dtype=output.dtype)
    _ORIG["all_to_all_single"](host_out, input.cpu(), *args, **kwargs)
    output.copy_(host_out)


def _all_gather(tensor_list, tensor, *args, **kwargs):
    if not _is_cuda(tensor):
        return _ORIG["all_gather"](tensor_list, tensor, *args, **kwargs)
    host = [torch.empty(t.shape, dtype=t.dtype) for t in tensor_list]
    _ORIG["all_gather"](host, tensor.cpu(), *args, **kwargs)
    for d, h in zip(tensor_list, host):
        d.copy_(h)


def _all_reduce(tensor, *args, **kwargs):
    # gloo's CUDA all-reduce has no bfloat16 kernel; the others run natively.
    if not (_is_cuda(tensor) and tensor.dtype == torch.bfloat16):
        return _ORIG["all_reduce"](tensor, *args, **kwargs)
    host = tensor.cpu()
    _ORIG["all_reduce"](host, *args, **kwargs)
    tensor.copy_(host)


def _isend(tensor, *args, **kwargs):
    # gloo's send work holds the host copy until it completes.
    return _ORIG["isend"](tensor.cpu() if _is_cuda(tensor) else tensor, *args, **kwargs)


def _irecv(tensor, *args, **kwargs):
    if not _is_cuda(tensor):
        return _ORIG["irecv"](tensor, *args, **kwargs)
    host = torch.empty(tensor.shape, dtype=tensor.dtype)
    return _StagedWork(_ORIG["irecv"](host, *args, **kwargs), [(tensor, host)])


def _send(tensor, *args, **kwargs):
    return _ORIG["send"](tensor.cpu() if _is_cuda(tensor) else tensor, *args, **kwargs)


def _recv(tensor, *args, **kwargs):
    if not _is_cuda(tensor):
        return _ORIG["recv"](tensor, *args, **kwargs)
    host = torch.empty(tensor.shape, dtype=tensor.dtype)
    out = _ORIG["recv"](host, *args, **kwargs)
    tensor.copy_(host)
    return out


def _batch_isend_irecv(p2p_op_list):
    if not any(_is_cuda(op.tensor) for op in p2p_op_list):
        return _ORIG["batch_isend_irecv"](p2p_op_list)
    host_ops, copies = [], []
    for op in p2p_op_list:
        t, mine = op.tensor, []
        if _is_cuda(t):
            if op.op in (dist.irecv, _ORIG["irecv"]):
                host = torch.empty(t.shape, dtype=t.dtype)
                mine.append((t, host))
            else:
                host = t.cpu()
            t = host
        host_ops.append(dist.P2POp(op.op, t, op.peer, op.group, op.tag))
        copies.append(mine)
    works = _ORIG["batch_isend_irecv"](host_ops)
    if len(works) == len(host_ops):
        # One work per op (gloo): each copies its own receive back, so callers that use a
        # chunk as soon as its work ends (the chunked ring) see it.
        return [_StagedWork(w, c) for w, c in zip(works, copies)]
    staged = [_StagedWork(w, []) for w in works]
    if staged:
        staged[-1].copies = [c for per in copies for c in per]
    return staged


def install() -> None:
    """Stage CUDA tensors through the host in the ops gloo cannot do on CUDA (idempotent).

    Patched in ``torch.distributed`` and in ``distributed_c10d`` itself: torch's own helpers
    (``send_object_list``, the pipeline's batched p2p, ``P2POp``'s check of its op) call the
    module's names, not the package's."""
    if _ORIG:
        return
    for name, fn in (("all_to_all_single", _all_to_all_single), ("all_gather", _all_gather),
                     ("all_reduce", _all_reduce), ("isend", _isend), ("irecv", _irecv), ("send", _send),
                     ("recv", _recv), ("batch_isend_irecv", _batch_isend_irecv)):
        _ORIG[name] = getattr(c10d, name)
        setattr(c10d, name, fn)
        setattr(dist, name, fn)
