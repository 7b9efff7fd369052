"""Each storage a run names, asked once before any worker starts.

Wrong credentials, a missing bucket or a server that does not answer would
otherwise surface minutes later, on a worker, at the first durable write or
the final save. A listing of each URI's path (one level; a path not made yet
is fine) is the cheapest call that every one of them fails; a server's refusal is not
retried, an unreachable server is (``retry.with_retries``).
"""

from __future__ import annotations

import pyarrow.fs as pafs

from .retry import StorageError, s3_error_code, with_retries
from .filesystems import StorageConfigError, open_fs
from .uris import is_uri, mask


def check_storage(places: list[tuple[str, str | None]], retries: int) -> None:
    """Raise a ``StorageConfigError`` naming the setting, its URI (masked) and the server's
    answer for the first of ``places`` ((setting, path or URI)) that cannot be listed. Local paths
    are left to their own checks."""
    for what, uri in places:
        if not uri or not is_uri(uri):
            continue
        fs, path = open_fs(uri, what)
        try:
            # Not allow_not_found: pyarrow then takes a missing bucket for an empty path.
            with_retries(lambda: fs.get_file_info(pafs.FileSelector(path)), f"listing {what}({uri})", retries)
        except FileNotFoundError:
            pass   # the bucket is there, the path not yet: a run makes it
        except (OSError, StorageError) as e:
            code = s3_error_code(e)
            said = f"the server answered {code}" if code else "it cannot be listed"
            raise StorageConfigError(f"{what}({mask(uri)!r}): {said}: {mask(str(e))}") from None
