"""A path or URI opened as a pyarrow filesystem, with the run's credentials and timeouts.

Local paths are local (made absolute). ``s3://bucket/path`` is opened here
rather than by ``pyarrow.fs.FileSystem.from_uri``, which takes neither the
credentials users write into a URI nor timeouts:

- options in the query: ``endpoint_override`` and ``scheme`` (MinIO, a
  local server: ``?endpoint_override=127.0.0.1:9000&scheme=http``),
  ``region``, ``connect_timeout`` and ``request_timeout`` (seconds), and the
  other ``S3FileSystem`` switches below;
- credentials: the URI's own, else those the driver took out of a URI of the
  same bucket (``storage.credentials``), else pyarrow's usual chain (the
  ``AWS_*`` variables, the instance's role);
- no request waits past its timeout: ``connect_timeout`` 5 s and
  ``request_timeout`` 30 s unless the URI says otherwise (a server that stops
  answering would otherwise hold a call for minutes); the S3 client retries a
  request 3 times itself, and ``retry.with_retries`` retries the operation.

Other schemes (``gs://``, ``hdfs://``, ``file://``) go to ``from_uri``.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import pyarrow.fs as pafs

from ..errors import ConfigError
from .credentials import lookup, take_credentials
from .uris import SECRET_PARAMS, is_uri, mask, split_secrets

CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 30.0
CLIENT_ATTEMPTS = 3

_FLOATS = ("connect_timeout", "request_timeout")
_BOOLS = ("allow_bucket_creation", "allow_bucket_deletion", "background_writes", "force_virtual_addressing",
          "check_directory_existence_before_creation", "tls_verify_certificates")
_STRINGS = ("endpoint_override", "scheme", "region", "tls_ca_file_path")


class StorageConfigError(ConfigError):
    """A storage path or URI that cannot be opened as given."""


def open_fs(path: str, what: str = "path") -> tuple[pafs.FileSystem, str]:
    """The filesystem of ``path`` and the path inside it. ``what`` names the setting in errors
    (``checkpoint.storage``); the URI is shown masked."""
    if not is_uri(path):
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
    if urlsplit(path).scheme == "s3":
        return _s3(path, what)
    try:
        return pafs.FileSystem.from_uri(_with_credentials(path))
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds; all mean the same here
        raise StorageConfigError(f"{what}({mask(path)!r}): cannot open filesystem: {mask(str(e))}") from None


def _with_credentials(uri: str) -> str:
    """``uri`` (not S3) with the credentials taken out of it (at the driver,
    ``storage.credentials``) put back where ``from_uri`` reads them: a user part
    (``abfs://account:KEY@container``, ``hdfs://user@host``) and the query (Azure's
    ``client_secret``). A parameter ``from_uri`` does not take is its error, masked."""
    clean, creds = split_secrets(uri)
    creds = dict(creds or lookup(uri))
    if not creds:
        return uri
    parts = urlsplit(clean)
    user = ":".join(quote(creds.pop(k), safe="") for k in ("access_key", "secret_key") if k in creds)
    netloc = f"{user}@{parts.netloc}" if user else parts.netloc
    query = parse_qsl(parts.query, keep_blank_values=True) + sorted(creds.items())
    return urlunsplit((parts.scheme, netloc, parts.path, urlencode(query, safe=":/"), parts.fragment))


def s3_options(uri: str, what: str = "path") -> tuple[dict, str]:
    """``S3FileSystem`` keyword arguments for ``uri`` (credentials included) and the path
    (``bucket/key``) inside it."""
    clean, creds = split_secrets(uri)
    parts = urlsplit(clean)
    if not parts.netloc:
        raise StorageConfigError(f"{what}({mask(uri)!r}) names no bucket: write s3://bucket/path")
    opts: dict = {"connect_timeout": CONNECT_TIMEOUT_S, "request_timeout": REQUEST_TIMEOUT_S}
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        if k not in _FLOATS + _BOOLS + _STRINGS:
            raise StorageConfigError(
                f"{what}({mask(uri)!r}): unknown option {k!r} in the URI; S3 URIs take "
                f"{', '.join(_STRINGS + _FLOATS + _BOOLS + SECRET_PARAMS)}")
        opts[k] = _option(k, v, uri, what)
    creds = creds or lookup(uri)
    other = sorted(k for k in creds if k not in SECRET_PARAMS)
    if other:
        raise StorageConfigError(f"{what}({mask(uri)!r}): {', '.join(other)} in the URI is not an S3 credential; "
                                 f"S3 URIs take {', '.join(SECRET_PARAMS)}")
    opts.update({k: v for k, v in creds.items() if v})
    if "endpoint_override" in opts and "region" not in opts:
        opts["region"] = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    opts["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=CLIENT_ATTEMPTS)
    return opts, f"{parts.netloc}{parts.path}".rstrip("/")


def _option(k: str, v: str, uri: str, what: str):
    if k in _STRINGS:
        return v
    if k in _FLOATS:
        try:
            return float(v)
        except ValueError:
            pass
    elif v.lower() in ("true", "false", "1", "0"):
        return v.lower() in ("true", "1")
    raise StorageConfigError(f"{what}({mask(uri)!r}): option {k}={v!r} is not "
                             f"{'a number of seconds' if k in _FLOATS else 'true or false'}")


def _s3(uri: str, what: str) -> tuple[pafs.FileSystem, str]:
    opts, where = s3_options(uri, what)
    take_credentials(uri)   # the same bucket opened again by its clean URI (a store's spec) finds them
    try:
        return pafs.S3FileSystem(**opts), where
    except Exception as e:  # noqa: BLE001
        raise StorageConfigError(f"{what}({mask(uri)!r}): cannot open S3: {mask(str(e))}") from None

