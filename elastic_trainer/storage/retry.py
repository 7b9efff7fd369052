"""Storage calls retried with exponential backoff: object stores fail transiently (throttling,
a dropped connection), and a checkpoint lost to one such error is a run's work lost."""

from __future__ import annotations

import logging
import re
import time
from typing import Callable, TypeVar

from ..errors import ElasticTrainerError
from .uris import mask

log = logging.getLogger(__name__)

T = TypeVar("T")


class StorageError(ElasticTrainerError):
    """Storage stayed unreachable or failing through every retry."""


# What an S3 server answers that no retry changes: credentials, permissions, a missing bucket.
# pyarrow raises every S3 error as a plain OSError naming the code ("AWS Error ACCESS_DENIED").
PERMANENT_S3 = frozenset({
    "ACCESS_DENIED", "SIGNATURE_DOES_NOT_MATCH", "INVALID_ACCESS_KEY_ID", "INVALID_CLIENT_TOKEN_ID",
    "UNRECOGNIZED_CLIENT", "EXPIRED_TOKEN", "MISSING_AUTHENTICATION_TOKEN", "NO_SUCH_BUCKET", "INVALID_SIGNATURE",
    "VALIDATION", "MALFORMED_QUERY_STRING", "OPT_IN_REQUIRED", "INCOMPLETE_SIGNATURE"})
_S3_CODE = re.compile(r"AWS Error ([A-Z_]+)")


def s3_error_code(e: BaseException) -> str | None:
    """The S3 error code pyarrow names in ``e`` (``ACCESS_DENIED``), if any."""
    m = _S3_CODE.search(str(e))
    return m.group(1) if m else None


def transient(e: BaseException) -> bool:
    """Whether ``e`` may pass on a retry: a storage I/O error, not a missing file, bucket or
    permission, nor credentials the server refused, which a retry cannot change."""
    if not isinstance(e, OSError) or isinstance(
            e, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
        return False
    return s3_error_code(e) not in PERMANENT_S3 and not _NO_BUCKET.search(str(e))


_NO_BUCKET = re.compile(r"Bucket '[^']*' not found")


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
                raise StorageError(mask(f"{what} failed after {retries + 1} attempts: {type(e).__name__}: {e}")) from e
            wait = backoff_s * 2 ** attempt
            log.warning("%s failed (%s: %s); retrying in %.1f s", mask(what), type(e).__name__, mask(str(e)), wait)
            time.sleep(wait)
    raise AssertionError("unreachable")
