"""The gradient codec interface: average one flat fp32 bucket over a data-parallel group, with per-bucket state.

See ``compression`` for the codecs and what their bytes count.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .stats import CommStats
from .timing import start_timer

Shapes = Sequence[tuple[int, Sequence[int]]]


def group_size(group) -> int:
    return dist.get_world_size(dist.group.WORLD if group is None else group)


def timed(stats: CommStats | None, op: str, nbytes: int, device: torch.device, fn, *args, **kwargs):
    """Run the collective ``fn(*args, **kwargs)`` on tensors of ``device``, counting ``nbytes`` and its time."""
    timer = start_timer(device) if stats is not None else None
    out = fn(*args, **kwargs)
    if stats is not None:
        stats.add(op, nbytes, timer.stop())
    return out


class Codec(ABC):
    """Base: per-bucket state as ``{"<kind>.<bucket>": tensor}``; subclasses define ``_average``."""

    name = ""
    options: tuple[str, ...] = ()
    state_kinds: tuple[str, ...] = ()
    # State that lives beside the bucket (on its device); the rest are host-side counters.
    device_kinds: tuple[str, ...] = ("residual",)

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
        p = group_size(group)
        self._to_device(bucket, flat.device)
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

    def _to_device(self, bucket: int, device: torch.device) -> None:
        """Move ``bucket``'s tensor state onto ``device``: state loaded from a snapshot arrives on
        the host, and a codec runs on the device of the bucket it is given."""
        for kind, per in self._state.items():
            t = per.get(bucket)
            if t is not None and t.device != device and kind in self.device_kinds:
                per[bucket] = t.to(device)

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
