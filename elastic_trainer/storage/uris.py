"""Storage URIs: their secrets taken out, and masked wherever a URI is shown.

A user may write credentials into an object-store URI, as the query
(``s3://bucket/path?access_key=...&secret_key=...&session_token=...``) or as
its user part (``s3://KEY:SECRET@bucket/path``), URL-encoded as in any URI (an
AWS secret's ``+`` and ``/`` as ``%2B`` and ``%2F``). Those never belong in a
record: the run takes them out of its config at the driver
(``storage.credentials``), and :func:`mask` hides any left in a line of text.
Which query parameters are credentials is ``elastic_trainer.secrets``' one rule
(S3's, GCS's and Azure's names, names that say so, the user's; any case):
:func:`split_secrets` takes out of a URI exactly what :func:`mask` hides in it.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from .. import secrets
from ..secrets import MASK, is_secret_name  # noqa: F401  (MASK: importable from here as before)

# The credentials S3FileSystem takes by name; a URI may spell them in any case.
SECRET_PARAMS = ("access_key", "secret_key", "session_token")


def is_uri(path: str) -> bool:
    """Whether ``path`` names a filesystem by scheme (``s3://...``) rather than a local path."""
    return "://" in path


def mask(text: str) -> str:
    """``text`` with every secret a storage URI (or an environment line, a connection string)
    in it may carry replaced by ``***`` (``secrets.mask``)."""
    return secrets.mask(text)


def split_secrets(uri: str) -> tuple[str, dict[str, str]]:
    """``uri`` without its credentials, and the credentials: every query parameter
    ``secrets.is_secret_name`` calls secret (any case; S3's three by their lower-case names,
    ``access_key``, ``secret_key``, ``session_token``, others as written) and a user part
    (``access_key``, ``secret_key``). A local path or a URI without any comes back as is."""
    if not is_uri(uri):
        return uri, {}
    parts = urlsplit(uri)
    creds: dict[str, str] = {}
    query = []
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        if is_secret_name(k):
            creds[k.lower() if k.lower() in SECRET_PARAMS else k] = v
        else:
            query.append((k, v))
    netloc = parts.netloc
    if "@" in netloc:
        user, netloc = netloc.rsplit("@", 1)
        key, _, secret = user.partition(":")
        creds.setdefault("access_key", unquote(key))
        if secret:
            creds.setdefault("secret_key", unquote(secret))
    if not creds:
        return uri, {}
    return urlunsplit((parts.scheme, netloc, parts.path, urlencode(query, safe=":/"), parts.fragment)), creds


def location(uri: str) -> str:
    """What credentials belong to: the scheme, the endpoint (where one is given) and the bucket,
    e.g. ``s3://127.0.0.1:9000/bucket``; a URI's path and other options do not change it."""
    parts = urlsplit(split_secrets(uri)[0])
    endpoint = dict(parse_qsl(parts.query)).get("endpoint_override", "")
    return f"{parts.scheme}://{endpoint}/{parts.netloc}"


def join(base: str, *names: str) -> str:
    """``base`` (a local path or a URI) with ``names`` appended to its path; a URI's query
    (its endpoint, its options) stays at its end."""
    if not is_uri(base):
        return "/".join([base.rstrip("/"), *names])
    p = urlsplit(base)
    return urlunsplit((p.scheme, p.netloc, "/".join([p.path.rstrip("/"), *names]), p.query, p.fragment))


def split_last(path: str) -> tuple[str, str]:
    """``(parent, last name)`` of a local path or a URI (the parent keeps the URI's query);
    the parent is '' where ``path`` is one name."""
    if not is_uri(path):
        parent, _, name = path.rstrip("/").rpartition("/")
        return parent, name
    p = urlsplit(path)
    head, _, name = p.path.rstrip("/").rpartition("/")
    return urlunsplit((p.scheme, p.netloc, head, p.query, p.fragment)), name
