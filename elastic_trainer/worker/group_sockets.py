"""The TCP sockets a plan's gloo groups hold, and cutting them when a peer goes silent.

gloo raises in a collective whose peer's process is gone, because the peer's
sockets close. A peer that stops without closing them (a frozen node: a
machine SIGSTOPped, or cut off the network) holds every rank that waits on it
until the collective timeout, seconds at least: ``ProcessGroupGloo.abort``
returns and leaves a pending receive waiting (torch 2.13). Shutting the
groups' connected sockets down ends such a receive at once ("Connection
closed by peer"), so the step raises as after a death and the rank joins the
next plan, in new groups.

Which sockets are the groups': those this process opened while it joined them
(``opened_during``). gloo connects a group's full mesh when it is built, and
the store's connections are made then too. Only TCP sockets are taken (Ray's
local links are Unix sockets). Listening sockets stay open: gloo's accept
loop ends the process when a listener is shut under it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket

log = logging.getLogger(__name__)

_FD_DIR = "/proc/self/fd"


def socket_fds() -> dict[int, str]:
    """fd -> ``socket:[inode]`` for each socket this process has open (Linux; {} elsewhere)."""
    out = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:
            continue   # closed meanwhile
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


class GroupSockets:
    """The connected TCP sockets of the groups last joined, to cut (``cut``) when a peer goes silent."""

    def __init__(self) -> None:
        self._held: dict[int, str] = {}

    @contextlib.contextmanager
    def opened_during(self):
        """Take the sockets opened inside this block as the groups' (a failed join's too)."""
        before = socket_fds()
        try:
            yield
        finally:
            self._held = {fd: link for fd, link in socket_fds().items() if before.get(fd) != link}

    def held(self) -> int:
        return len(self._held)

    def forget(self) -> None:
        """The groups are gone (destroyed): their fds may be reused by anything."""
        self._held = {}

    def _connected(self):
        """Each held fd that is still the groups' and a connected TCP socket, as a duplicate
        socket object (closed once the caller moves on): acting on it acts on the connection."""
        for fd, link in self._held.items():
            try:
                dup = os.dup(fd)
            except OSError:
                continue   # closed
            if f"socket:[{os.fstat(dup).st_ino}]" != link:
                os.close(dup)   # the number was reused for another file
                continue
            try:
                s = socket.socket(fileno=dup)
            except OSError:
                os.close(dup)
                continue
            try:
                if (s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM
                        and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                    yield s
            except OSError:
                pass
            finally:
                s.close()

    def cut(self) -> int:
        """Shut down the groups' connected TCP sockets, so that every receive on them ends now;
        returns how many. The fds stay open (the groups still own them) until the groups are
        destroyed."""
        cut = 0
        for s in self._connected():
            try:
                s.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:
                pass   # not connected (any more)
        self._held = {}
        return cut

    def addresses(self) -> list[tuple[str, int]]:
        """(host, port) of this process's end of each connection the groups hold: a peer whose
        connection closes names it ("Connection closed by peer [host]:port"), which tells the
        controller this process is gone before anything else does."""
        out = []
        for s in self._connected():
            try:
                host, port = s.getsockname()[:2]
            except OSError:
                continue
            out.append((host, port))
        return out
