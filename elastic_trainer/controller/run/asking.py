"""Asking workers, many at once: every answer within a bound (``ask_all``), or one call per rank
whose failures raise, naming the workers (``get_all``). Nothing here holds the pool."""

from __future__ import annotations

import logging
import time
from typing import Callable

import ray

from ...errors import ElasticTrainerError, WorkerError, error_line

log = logging.getLogger(__name__)


def ask_all(refs: dict, timeout: float) -> dict:
    """Wait up to ``timeout`` for every ref of ``{key: ref}``; ``{key: value}``, where a
    failed call's value is its exception and an unanswered one's a ``TimeoutError``."""
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout) if refs else ([], [])
    ready = set(ready)
    out = {}
    for key, ref in refs.items():
        if ref not in ready:
            out[key] = TimeoutError(f"no answer in {timeout:g}s")
            continue
        try:
            out[key] = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - the caller decides what a failed answer means
            out[key] = e
    return out


def get_all(refs: dict, ranks: dict, timeout: float, what: str,
            progress: Callable[[list[int]], dict] | None = None) -> dict:
    """Results of one call per rank (``refs``: rank -> ref; ``ranks``: rank -> worker id). A dead
    worker ends the wait at once (the others would only time out waiting for it); failures raise
    a WorkerError naming them. ``progress(worker ids)``: each one's count of work done in
    this call, from (0, 0); asked only past ``timeout``, when the wait goes on for another
    ``timeout`` each time a pending worker's count has moved since the last look (slow, not
    stuck), and ends when none has."""
    deadline = time.perf_counter() + timeout
    pending = {ref: r for r, ref in refs.items()}
    out, bad = {}, {}
    seen: dict = {}   # a set-up's count starts at nothing (``worker.setup_progress``)
    while pending and not bad:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.perf_counter()))
        if not ready:
            if progress is None:
                break
            now = progress([ranks[r] for r in pending.values()])
            if not any(now.get(w) is not None and now.get(w) != seen.get(w, (0, 0)) for w in now):
                break
            log.info("%s: still making progress past %gs (%s); waiting on", what, timeout,
                     ", ".join(f"worker {w}: {now[w]}" for w in sorted(now)))
            seen.update(now)
            deadline = time.perf_counter() + timeout
            continue
        for ref in ready:
            r = pending.pop(ref)
            try:
                out[r] = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                cause = e.as_instanceof_cause()
                if isinstance(cause, ElasticTrainerError):
                    raise cause from None
                bad[ranks[r]] = cause
            except ray.exceptions.RayError as e:
                bad[ranks[r]] = e
    if not bad:
        for r in pending.values():
            bad[ranks[r]] = TimeoutError(f"no answer in {timeout:g}s")
    if bad:
        err = WorkerError(f"workers failed to {what}: " + "; ".join(
            f"worker {w}: {error_line(e)}"
            for w, e in bad.items()))
        err.failed_workers = sorted(bad)
        raise err
    return out


def failed(value) -> bool:
    """Whether an answer of :func:`ask_all` is a failure."""
    return isinstance(value, BaseException)
