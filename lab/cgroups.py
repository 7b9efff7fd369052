"""A lab host's cgroup: its CPU quota, memory limit, freezer, and the processes in it.

Both cgroup layouts are handled. On v1 (one hierarchy per controller, under
``/sys/fs/cgroup/<controller>``) a host is a directory in each of the ``cpu``,
``memory`` and ``freezer`` hierarchies; on v2 (one unified hierarchy) it is one
directory with ``cpu.max``, ``memory.max`` and ``cgroup.freeze``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("cpu", "memory", "freezer")
_PERIOD_US = 100_000


def version() -> int | None:
    """2 on a unified hierarchy, 1 where the cpu, memory and freezer controllers each have one,
    None where neither is usable."""
    if (ROOT / "cgroup.controllers").exists():
        wanted = {"cpu", "memory"}
        enabled = set((ROOT / "cgroup.subtree_control").read_text().split())
        have = set((ROOT / "cgroup.controllers").read_text().split())
        return 2 if wanted <= (have | enabled) else None
    return 1 if all((ROOT / c / "cgroup.procs").exists() for c in V1_CONTROLLERS) else None


class HostGroup:
    """One host's cgroup, named ``path`` (relative, e.g. ``etlab-ab12/h1``) in every controller."""

    def __init__(self, path: str, cpus: float, memory_bytes: int | None):
        self.path = path
        self.v = version()
        if self.v is None:
            raise RuntimeError(f"no usable cgroup controllers under {ROOT} (cpu, memory and freezer on v1, "
                               "or cpu and memory on a v2 unified hierarchy)")
        self.dirs = ([ROOT / c / path for c in V1_CONTROLLERS] if self.v == 1 else [ROOT / path])
        for d in self.dirs:
            _make(d, unified=self.v == 2)
        self.set_cpus(cpus)
        self.set_memory(memory_bytes)

    def _file(self, controller: str, v1: str, v2: str) -> Path:
        return (ROOT / controller / self.path / v1) if self.v == 1 else (ROOT / self.path / v2)

    def set_cpus(self, cpus: float) -> None:
        """A CFS quota of ``cpus`` cores (1.5: 150 ms of CPU every 100 ms)."""
        self.cpus = cpus
        quota = max(1000, int(cpus * _PERIOD_US))
        if self.v == 1:
            (ROOT / "cpu" / self.path / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
            (ROOT / "cpu" / self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (ROOT / self.path / "cpu.max").write_text(f"{quota} {_PERIOD_US}")

    def set_memory(self, limit_bytes: int | None) -> None:
        """The host's memory limit (None: none); past it, the kernel's OOM killer picks a process
        in this cgroup."""
        if self.v == 1:
            (ROOT / "memory" / self.path / "memory.limit_in_bytes").write_text(
                str(limit_bytes) if limit_bytes else "-1")
        else:
            (ROOT / self.path / "memory.max").write_text(str(limit_bytes) if limit_bytes else "max")

    def memory_usage(self) -> int:
        """Bytes the cgroup's processes use now (page cache included, as the limit counts it)."""
        if self.v == 1:
            return int((ROOT / "memory" / self.path / "memory.usage_in_bytes").read_text())
        return int((ROOT / self.path / "memory.current").read_text())

    def memory_events(self) -> dict[str, int]:
        """The kernel's count of OOM kills in this cgroup (``oom_kill``), and how often it hit
        its limit (``max``/``failcnt``)."""
        if self.v == 1:
            ctl = dict(line.split() for line in (ROOT / "memory" / self.path / "memory.oom_control")
                       .read_text().splitlines() if line.strip())
            fail = int((ROOT / "memory" / self.path / "memory.failcnt").read_text())
            return {"oom_kill": int(ctl.get("oom_kill", 0)), "max": fail}
        ev = dict(line.split() for line in (ROOT / self.path / "memory.events").read_text().splitlines())
        return {"oom_kill": int(ev.get("oom_kill", 0)), "max": int(ev.get("max", 0))}

    def procs_files(self) -> list[Path]:
        """The ``cgroup.procs`` files a process is written into to join this host."""
        return [d / "cgroup.procs" for d in self.dirs]

    def pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
            except FileNotFoundError:
                pass
        return sorted(out)

    def freeze(self) -> None:
        """Stop every process of the host where it stands (no signal it can see, no socket closed)."""
        self._set_frozen(True)

    def thaw(self) -> None:
        self._set_frozen(False)

    def _set_frozen(self, frozen: bool) -> None:
        if self.v == 1:
            f = ROOT / "freezer" / self.path / "freezer.state"
            f.write_text("FROZEN" if frozen else "THAWED")
            want = "FROZEN" if frozen else "THAWED"
            deadline = time.monotonic() + 10
            while f.read_text().strip() != want and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            (ROOT / self.path / "cgroup.freeze").write_text("1" if frozen else "0")

    def kill(self) -> int:
        """SIGKILL every process of the host, at once: frozen first, so none forks past the kill.
        Returns how many were killed."""
        if self.v == 2 and (ROOT / self.path / "cgroup.kill").exists():
            n = len(self.pids())
            (ROOT / self.path / "cgroup.kill").write_text("1")
            _await_empty(self)
            return n
        self._set_frozen(True)
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._set_frozen(False)  # a frozen process dies of SIGKILL only once thawed
        _await_empty(self)
        return len(pids)

    def remove(self) -> None:
        """Kill what is left and remove the cgroup (and its lab's parent, once empty)."""
        if any(d.exists() for d in self.dirs):
            self.kill()
        for d in self.dirs:
            remove_tree(d)


def _make(d: Path, unified: bool) -> None:
    if unified:
        # v2: a child gets a controller only where every parent hands it down.
        p = ROOT
        for part in d.relative_to(ROOT).parts:
            (p / "cgroup.subtree_control").write_text("+cpu +memory")
            p = p / part
            p.mkdir(exist_ok=True)
    else:
        d.mkdir(parents=True, exist_ok=True)


def _await_empty(group: HostGroup, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while group.pids():
        if time.monotonic() > deadline:
            raise RuntimeError(f"cgroup {group.path}: processes {group.pids()} outlived SIGKILL for {timeout_s:g} s")
        time.sleep(0.01)


def remove_tree(d: Path) -> None:
    """rmdir ``d`` and every cgroup below it, deepest first (a cgroup directory holds only the
    kernel's files, which rmdir removes with it)."""
    if not d.exists():
        return
    for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        _rmdir(sub)
    _rmdir(d)


def _rmdir(d: Path) -> None:
    deadline = time.monotonic() + 5
    while True:
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: a process that was just killed is still leaving it
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def lab_roots(prefix: str) -> list[Path]:
    """Every cgroup directory a lab named ``prefix...`` made, in any controller."""
    tops = [ROOT / c for c in V1_CONTROLLERS] + [ROOT]
    return sorted({p for t in tops if t.is_dir() for p in t.iterdir() if p.is_dir() and p.name.startswith(prefix)})


def kill_tree(d: Path) -> None:
    """SIGKILL every process in cgroup ``d`` and below, thawing any frozen one so it dies."""
    for f in d.rglob("cgroup.procs"):
        for pid in f.read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    for f in list(d.rglob("freezer.state")) + list(d.rglob("cgroup.freeze")):
        try:
            f.write_text("THAWED" if f.name == "freezer.state" else "0")
        except OSError:
            pass  # the root of a v1 freezer hierarchy has no state to write


def remove_tree_everywhere(prefix: str) -> None:
    """Kill and remove every cgroup named ``prefix...`` in every controller."""
    for root in lab_roots(prefix):
        kill_tree(root)
        remove_tree(root)
