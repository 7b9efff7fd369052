"""Whether a node-mate's process runs, read from /proc: what lets one worker answer the heartbeat for its node.

The controller's heartbeat asks one worker a node (``TrainWorker.ping_node``)
instead of every rank, so its calls grow with the nodes, not the ranks. The
one asked answers for itself by answering, and for each node-mate by its
process's state: a process stopped (SIGSTOP, a frozen container) is not
running and stays unheard; a whole frozen node answers nothing at all.

A process is named by its pid and its start time (``mark``), so a pid reused
by another process, or one in another pid namespace, reads as unknown (then
the controller pings that rank itself), never as running. Where /proc does
not exist every node-mate is unknown.

What this cannot see: a process that runs but is stuck (a deadlock holding
the interpreter). Such a rank answers no call, and the step timeout takes it.
"""

from __future__ import annotations

import os
import signal

# /proc/<pid>/stat states of a process that does not run: stopped, traced, zombie, dead.
_NOT_RUNNING = frozenset("TtZXx")


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # The command may hold spaces and parentheses: the fields start after its last ")".
    return text[text.rfind(")") + 2:].split()


def process_mark(pid: int | None = None) -> str | None:
    """The start time of ``pid`` (this process by default) in clock ticks since boot, which
    with the pid names one process; None where /proc cannot say."""
    fields = _stat(os.getpid() if pid is None else pid)
    return fields[19] if fields and len(fields) > 19 else None


def running(pid: int, mark: str) -> bool | None:
    """Whether the process ``(pid, mark)`` runs: False when stopped or dead, None when /proc
    does not show that process (gone, another one on its pid, or no /proc)."""
    fields = _stat(pid)
    if not fields or len(fields) <= 19 or fields[19] != mark:
        return None
    return fields[0] not in _NOT_RUNNING


def kill_marked(pid: int, mark: str | None) -> str:
    """SIGKILL the process ``(pid, mark)`` and no other: ``killed``, ``gone`` (no such process
    runs: it ended, or its pid is another's now) or ``unmarked`` (killed by pid alone: no /proc
    named its start time when it joined). Race-free where the kernel has pidfds: the mark is read
    after the pidfd is open, so the signal goes to the process that was checked."""
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, AttributeError, OSError) as e:
        if isinstance(e, ProcessLookupError):
            return "gone"
        fd = None
    try:
        if mark is not None and process_mark(pid) != mark:
            return "gone"
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return "gone"
        return "killed" if mark is not None else "unmarked"
    finally:
        if fd is not None:
            os.close(fd)
