"""This process's memory, as the kernel counts it: resident now, and its peak since the last reset.

Linux keeps a process's peak resident set (``VmHWM``) and lets the process
reset it (``/proc/self/clear_refs``, value 5), so a set-up's peak and each
step's are measured apart. On a GPU the device's peak allocation is
``torch.cuda.max_memory_allocated``, reset the same way. Where ``/proc`` is
not there, the figures are None.
"""

from __future__ import annotations

import os

import torch


def rss_bytes() -> int | None:
    """Resident set size now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes() -> int | None:
    """The peak resident set size since the process started, or since ``reset_peaks``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cuda_peak_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def reset_peaks(device: torch.device) -> None:
    """Start the peaks anew from what is resident (allocated) now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
