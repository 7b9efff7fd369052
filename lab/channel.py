"""Requests from a program on a lab host to the lab's owner outside it, through a shared folder.

A program inside a host (the campaign's driver on the head) sees the lab's Ray cluster but can
not act on the lab itself: a link is taken down, a host frozen or its memory limited from the
machine's own namespace, by the ``Lab`` that made them. Both sides see the same folder (hosts
differ in their network, not their files), so a request is a file the program writes and the
owner answers with another: one at a time, in order, each written whole (write, then rename).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class ChannelClosed(RuntimeError):
    """The other side is gone, or did not answer in time."""


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


class Channel:
    """The folder ``root``: ``call`` on the host's side, ``serve_pending`` on the owner's."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._sent = 0
        self._answered: set[str] = set()

    def call(self, op: str, timeout_s: float = 180.0, **args) -> dict:
        """Ask the owner for ``op`` with ``args`` and wait for its answer (a dict). Raises
        ``ChannelClosed`` when none comes in ``timeout_s``, and with the owner's error."""
        self._sent += 1
        n = f"{os.getpid()}-{self._sent:06d}"
        _write(self.root / f"req-{n}.json", {"op": op, **args})
        answer = self.root / f"ans-{n}.json"
        deadline = time.monotonic() + timeout_s
        while not answer.exists():
            if time.monotonic() > deadline:
                raise ChannelClosed(f"no answer to {op!r} from the lab's owner in {timeout_s:g} s ({self.root})")
            time.sleep(0.02)
        doc = json.loads(answer.read_text())
        answer.unlink()
        if "error" in doc:
            raise ChannelClosed(f"the lab's owner could not do {op!r}: {doc['error']}")
        return doc["result"]

    def serve_pending(self, handle) -> int:
        """Answer every request not yet answered, in the order sent, with ``handle(request)``
        (its exception becomes the caller's error); how many were answered."""
        done = 0
        for req in sorted(self.root.glob("req-*.json")):
            if req.name in self._answered:
                continue
            doc = json.loads(req.read_text())
            try:
                answer = {"result": handle(doc)}
            except Exception as e:  # noqa: BLE001 - the host's side raises it, with its cause
                answer = {"error": f"{type(e).__name__}: {e}"}
            req.unlink()
            _write(self.root / req.name.replace("req-", "ans-"), answer)
            self._answered.add(req.name)
            done += 1
        return done
