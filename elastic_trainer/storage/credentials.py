"""Storage credentials: out of the config, into the run's runtime environment.

Credentials written into a URI (see ``storage.uris``) are taken out of the
config at the driver, before anything records it, and kept in this process's
environment under ``ELASTIC_TRAINER_STORAGE_CREDENTIALS`` (JSON: location ->
credentials, a location being the scheme, endpoint and bucket). The run
passes that variable, and the usual ``AWS_*`` ones where the driver has them,
to the controller and every worker through Ray's runtime environment, so a
node that shares nothing with the driver reads and writes the same storage.
``storage.filesystems`` looks a URI's location up there when it opens it.
"""

from __future__ import annotations

import json
import os

from ..errors import ConfigError, ElasticTrainerError
from .uris import is_uri, location, mask, split_secrets

ENV = "ELASTIC_TRAINER_STORAGE_CREDENTIALS"
# What pyarrow's S3 client reads from the environment itself.
FORWARDED = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION",
             "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


class CredentialsConflict(ElasticTrainerError):
    """Two URIs of one location carry different credentials. Not a ``ValueError``: pydantic
    would wrap one with the config it was given, secrets and all."""


def _known() -> dict[str, dict[str, str]]:
    try:
        return json.loads(os.environ.get(ENV) or "{}")
    except json.JSONDecodeError:
        raise ConfigError(f"the environment variable {ENV} is not the JSON this package writes there; "
                          "unset it") from None


def lookup(uri: str) -> dict[str, str]:
    """The credentials taken out of a URI of ``uri``'s location ({} where none were)."""
    return _known().get(location(uri), {}) if is_uri(uri) else {}


def take_credentials(raw):
    """``raw`` (a config as dicts, lists and strings) with every URI's credentials taken out and
    kept in this process's environment (:data:`ENV`). Two URIs of one location must carry the
    same credentials (or one none)."""
    known = _known()
    taken: dict[str, dict[str, str]] = {}

    def walk(v):
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, str) and is_uri(v):
            clean, creds = split_secrets(v)
            if creds:
                where = location(v)
                if where in taken and taken[where] != creds:
                    raise CredentialsConflict(f"two URIs of {where} carry different credentials ({mask(v)}); give "
                                      "one location one set")
                taken[where] = creds
            return clean
        return v

    out = walk(raw)
    if taken:
        known.update(taken)
        os.environ[ENV] = json.dumps(known)
    return out


def storage_env() -> dict[str, str]:
    """The environment variables the controller and the workers need to reach the run's storage:
    :data:`ENV` and the ``AWS_*`` credentials this process has."""
    return {k: os.environ[k] for k in (ENV, *FORWARDED) if os.environ.get(k)}
