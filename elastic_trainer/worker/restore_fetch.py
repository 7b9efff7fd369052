"""Where a restoring rank gets its shards: its own local copies as they are, the rest fetched at once."""

from __future__ import annotations

import time

import ray

from ..checkpoint.state import select_blocks, shard_nbytes
from .copies import HeldCopies
from .local_wait import wait_local
from .process_group import SetupAborted
from .setup_progress import PROGRESS


def fetch_sources(sources: list, copies: HeldCopies, aborted=lambda: False, worker_id: int = -1,
                  want: tuple | None = None) -> tuple[list[dict], dict]:
    """The shards to load: local copies as they are, the others fetched at once (in
    parallel). ``moved``: bytes that came from other workers' copies, and the seconds
    that took (``("own", ref)`` is this worker's own object-store part: not moved), and
    ``regather``: what fetching whole the parts it read of its blocks would have moved.

    ``("read", actor, method, args)`` asks a live worker for a snapshot part cut to ``want``
    (``StageState.restore_want``: this rank's blocks, and the moments' ranges it owns), so a
    sharded rank moves only the ranges it now owns.

    An object whose node just died can block a fetch for tens of seconds, until Ray
    declares it lost; the wait polls (``local_wait``) so that ``aborted()`` (the controller
    gave this set-up up) ends it at once."""
    out: list = [None] * len(sources)
    remote = {}
    used: list[int] = []   # the set-up generations of the local copies read
    for i, s in enumerate(sources):
        if isinstance(s, tuple) and s[0] == "local":
            out[i] = copies.local_copy(s[1])
            used.append(copies.made_in.get(s[1], 0))
        elif isinstance(s, tuple) and s[0] == "own":
            out[i] = ray.get(s[1])
        elif isinstance(s, tuple) and s[0] == "read":
            _, actor, method, args = s
            remote[i] = getattr(actor, method).remote(*args, want=want)
        else:
            remote[i] = s
    t0 = time.perf_counter()
    if not wait_local(list(remote.values()), aborted, PROGRESS.tick):
        raise SetupAborted(f"worker {worker_id} stopped fetching its restore sources: "
                           "the controller abandoned this plan")
    for i, shard in zip(remote, ray.get(list(remote.values()))):
        out[i] = shard
    moved = {"bytes": sum(shard_nbytes(out[i]) for i in remote), "seconds": time.perf_counter() - t0,
             "regather": sum(s.get("regather_nbytes") or shard_nbytes(select_blocks(s, want[0] if want else s["blocks"]))
                             for s in out),
             "local_generations": used}
    return out, moved
