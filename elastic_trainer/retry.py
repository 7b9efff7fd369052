"""Storage calls retried with exponential backoff: object stores fail transiently (throttling,
a dropped connection), and a checkpoint lost to one such error is a run's work lost."""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

from .errors import ElasticTrainerError

log = logging.getLogger(__name__)

T = TypeVar("T")


class StorageError(ElasticTrainerError):
    """Storage stayed unreachable or failing through every retry."""


def transient(e: BaseException) -> bool:
    """Whether ``e`` may pass on a retry: a storage I/O error, not a missing file or a
    permission the retry cannot change."""
    return isinstance(e, OSError) and not isinstance(
        e, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError)


def with_retries(fn: Callable[[], T], what: str, retries: int, backoff_s: float = 0.5) -> T:
    """``fn()``, retried ``retries`` times after a transient error (waiting ``backoff_s``, then
    twice that, ...). The last error is raised as a :class:`StorageError` naming ``what``."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - sorted by transient()
            if not transient(e):
                raise
            if attempt == retries:
                raise StorageError(f"{what} failed after {retries + 1} attempts: {type(e).__name__}: {e}") from e
            wait = backoff_s * 2 ** attempt
            log.warning("%s failed (%s: %s); retrying in %.1f s", what, type(e).__name__, e, wait)
            time.sleep(wait)
    raise AssertionError("unreachable")
