"""A process's memory cgroup: how many processes the kernel's OOM killer has killed in it, and its limit.

A worker killed for memory (its host's limit, or a container's) dies by
SIGKILL like any other: its peers see a death, and nothing in Ray's error says
why. The kernel counts those kills per cgroup. Read on a worker's node when it
joins and again after it died, a count that rose says the death was memory's
(``controller.memory_kills``).
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# v1 writes "no limit" as the largest page-aligned int64.
_NO_LIMIT_V1 = 1 << 62


def _memory_dirs(proc_cgroup: str, root: str) -> tuple[list[Path], bool] | None:
    """The directories where this process's memory cgroup may be (its path under the hierarchy,
    then the hierarchy's root: inside a container the path is the host's, and the container's
    own cgroup is mounted at the root), and whether it is v2; None where there is none."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    entries = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    for hid, controllers, path in entries:
        if "memory" in controllers.split(","):
            base = Path(root) / "memory"
            return [base / path.lstrip("/"), base], False
    for hid, controllers, path in entries:
        if hid == "0" and controllers == "":
            return [Path(root) / path.lstrip("/"), Path(root)], True
    return None


def _read(dirs: list[Path], name: str) -> str | None:
    for d in dirs:
        try:
            return (d / name).read_text()
        except OSError:
            continue
    return None


def oom_kills(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The ``oom_kill`` count of this process's memory cgroup (v1: ``memory.oom_control``; v2:
    ``memory.events``), None where it cannot be read (no cgroup, another OS)."""
    found = _memory_dirs(proc_cgroup, root)
    if found is None:
        return None
    dirs, v2 = found
    text = _read(dirs, "memory.events" if v2 else "memory.oom_control")
    if text is None:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            try:
                return int(value)
            except ValueError:
                return None   # a file not as the kernel writes it: no count rather than no worker
    return 0   # the file without the counter: an older kernel, no kill counted


def memory_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The memory limit in bytes of this process's cgroup (v1: ``memory.limit_in_bytes``; v2:
    ``memory.max``), None where there is none or it cannot be read."""
    found = _memory_dirs(proc_cgroup, root)
    if found is None:
        return None
    dirs, v2 = found
    text = _read(dirs, "memory.max" if v2 else "memory.limit_in_bytes")
    if text is None or text.strip() == "max":
        return None
    try:
        limit = int(text.strip())
    except ValueError:
        return None
    return None if limit >= _NO_LIMIT_V1 else limit


def grow_until_killed(chunk_mb: int = 64, proc_cgroup: str = "/proc/self/cgroup",
                      root: str = "/sys/fs/cgroup") -> None:
    """A chaos hook (``TrainWorker.inject_fault("grow_memory")``): take memory, every page
    written, until the kernel kills this process for its cgroup's limit. Refused where the
    process has no limit (the machine's own OOM killer might pick any process); raises if it
    got past its limit and lives (swap, say), having let the memory go."""
    limit = memory_limit(proc_cgroup, root)
    if limit is None:
        raise RuntimeError("grow_memory needs a memory limit on the worker's cgroup (a container's, or a "
                           "lab host's); this worker has none, and growing would take the machine's memory")
    log.warning("growing past this worker's memory limit (%.2f GB) until the kernel kills it", limit / 2**30)
    held, chunk = [], chunk_mb << 20
    while len(held) * chunk < limit + (512 << 20):
        held.append(b"\x01" * chunk)   # written, so every page is resident
    held.clear()
    raise RuntimeError(f"grew to {limit / 2**30 + 0.5:.2f} GB, past the {limit / 2**30:.2f} GB limit, and was not killed")
