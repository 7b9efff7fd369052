"""How long a collective took, measured where it runs.

On CPU tensors a collective is done when the call returns, so a wall clock
around the call is its time. On CUDA tensors the call only queues work on a
stream and returns at once; a wall clock would time the launch. There the
time is the interval between two CUDA events recorded on the current stream
around the call, read once the later event has completed, so reading it at
the end of a step costs no synchronisation inside it.
"""

from __future__ import annotations

import time

import torch


class WallTimer:
    """Seconds between construction and :meth:`stop`, on the host clock (CPU tensors)."""

    kind = "wall"

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._seconds: float | None = None

    def stop(self) -> WallTimer:
        self._seconds = time.perf_counter() - self._t0
        return self

    def seconds(self) -> float:
        if self._seconds is None:
            raise RuntimeError("timer read before stop()")
        return self._seconds


class EventTimer:
    """Seconds between two CUDA events on the current stream of ``device`` (CUDA tensors)."""

    kind = "cuda_event"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start = torch.cuda.Event(enable_timing=True)
        self._end: torch.cuda.Event | None = None
        self._start.record(torch.cuda.current_stream(device))

    def stop(self) -> EventTimer:
        self._end = torch.cuda.Event(enable_timing=True)
        self._end.record(torch.cuda.current_stream(self.device))
        return self

    def seconds(self) -> float:
        if self._end is None:
            raise RuntimeError("timer read before stop()")
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3


def timer_kind(device: torch.device | str) -> str:
    """Which clock times a collective on ``device``: ``cuda_event`` for CUDA, else ``wall``."""
    return EventTimer.kind if torch.device(device).type == "cuda" else WallTimer.kind


def start_timer(device: torch.device | str) -> WallTimer | EventTimer:
    """A running timer for work on ``device`` (see :func:`timer_kind`); ``stop()`` it after the work."""
    device = torch.device(device)
    return EventTimer(device) if timer_kind(device) == EventTimer.kind else WallTimer()
