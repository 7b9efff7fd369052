"""Which names hold secrets, and secrets hidden wherever text, a URI or a config is recorded.

One rule, case-insensitive, for a URI's query parameter, an environment variable and a key of
a dict alike (:func:`is_secret_name`): a name is secret-valued when it is

- a credential name of a storage: S3's ``access_key``, ``secret_key``, ``session_token`` and
  ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``; GCS's ``access_token``,
  ``credentials``, ``private_key``, ``client_secret``, ``GOOGLE_APPLICATION_CREDENTIALS``;
  Azure's ``account_key``, ``sas_token``, a SAS's ``sig``, ``client_secret``, a connection
  string and its ``AccountKey``, ``AZURE_STORAGE_KEY``, ...;
- or a name that says so: it holds ``SECRET``, ``TOKEN``, ``PASSWORD``, ``PASSWD``, ``KEY``,
  ``CREDENTIAL`` or ``SIGNATURE`` (``MY_API_TOKEN``, ``HF_TOKEN``, ``WANDB_API_KEY``);
- or a name the user gave (``run.secret_names``): :func:`remember_names` adds them for this process.

:func:`mask` replaces the value of every such ``name=value`` (a query, an environment line, a
connection string), ``"name": "value"`` (JSON, a dict's repr), a URI's ``user:password@`` and
a PEM private key by ``***``. ``storage.uris.split_secrets`` takes out of a URI exactly what
:func:`mask` hides in it.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Iterable, Mapping

MASK = "***"

# Credential names of the stores pyarrow and their SDKs read (query parameters, options,
# environment variables); each is also caught by _WORDS, but is listed so the rule says what it covers.
CREDENTIAL_NAMES = frozenset(n.lower() for n in (
    # S3 (pyarrow.fs.S3FileSystem, the AWS SDK)
    "access_key", "secret_key", "session_token", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    # GCS (pyarrow.fs.GcsFileSystem, google-auth)
    "access_token", "refresh_token", "credentials", "credential", "private_key", "private_key_id",
    "client_secret", "GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_AUTH_ACCESS_TOKEN",
    # Azure (pyarrow.fs.AzureFileSystem, the Azure SDK, SAS URLs, connection strings)
    "account_key", "AccountKey", "sas_token", "sig", "SharedAccessSignature", "connection_string",
    "AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_CONNECTION_STRING", "AZURE_CLIENT_SECRET",
    # this package's own store of the credentials taken out of URIs (storage.credentials)
    "ELASTIC_TRAINER_STORAGE_CREDENTIALS",
    "password", "passwd",
))
_WORDS = ("secret", "token", "password", "passwd", "key", "credential", "signature")
# A name's segments: split at _ . - and where a lower-case letter meets an upper-case one.
_SEGMENTS = re.compile(r"[_.\-]+|(?<=[a-z0-9])(?=[A-Z])")

_extra: set[str] = set()   # names given by users of this process (run.secret_names)


def remember_names(names: Iterable[str]) -> None:
    """Treat ``names`` (any case) as secret-valued in this process from now on."""
    _extra.update(n.lower() for n in names if n)


def is_secret_name(name: str, extra: Iterable[str] = ()) -> bool:
    """Whether ``name`` (a query parameter, an environment variable, a key) holds a secret:
    a credential name; a name one of whose segments (split at ``_ . -`` and camel case) is, or
    ends with, a secret word (``HF_TOKEN``, ``apiKey``, ``x-amz-security-token``; not
    ``tokens_per_s``); one of ``extra`` or of the names remembered (:func:`remember_names`).
    Case-insensitive."""
    low = name.lower()
    if low in CREDENTIAL_NAMES or low in _extra or low in {e.lower() for e in extra}:
        return True
    return any(seg.endswith(w) for seg in _SEGMENTS.split(name) for w in _WORDS for seg in [seg.lower()])


# Every ``name=value`` and ``"name": value``; :func:`mask` hides the value where the name is
# secret. A value: a quoted string, or up to the next separator (& ; , whitespace, a quote, a bracket).
_QUOTED = r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'"
_NAMED = re.compile(
    r"(?P<q>[\"']?)(?<![\w.-])(?P<name>[A-Za-z_][\w.-]*)(?P=q)"      # name, "name" or 'name'
    r"(?P<sep>\s*=\s*|(?<=[\"'])\s*:\s*)"                          # = anywhere; : after a quoted name
    rf"(?P<value>{_QUOTED}|[^&;,\s'\"}}\])]+)")
_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)([^/@\s'\"]+)@")
_PEM = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)", re.S)


def mask(text: str, extra: Iterable[str] = ()) -> str:
    """``text`` with every secret value in it replaced by ``***``: values of secret-named
    parameters, variables and keys (:func:`is_secret_name`; ``extra``: more names), a URI's
    ``user:password@``, a PEM private key."""
    if not text or not isinstance(text, str):
        return text
    extra = list(extra)
    if "=" in text or ":" in text:
        def hide(m: re.Match) -> str:
            value = m.group("value")
            quote = value[0] if value[0] in "\"'" else ""
            inner = value[1:-1] if quote else value
            # An ordinary name's value may hold a secret of its own (a URI's query): looked into.
            inner = mask(inner, extra) if not is_secret_name(m.group("name"), extra) else MASK
            return f"{m.group('q')}{m.group('name')}{m.group('q')}{m.group('sep')}{quote}{inner}{quote}"
        text = _NAMED.sub(hide, text)
    if "@" in text:
        text = _USERINFO.sub(lambda m: f"{m.group(1)}{MASK}@", text)
    if "PRIVATE KEY-----" in text:
        text = _PEM.sub(MASK, text)
    return text


def mask_values(value: Any, extra: Iterable[str] = ()) -> Any:
    """``value`` (dicts, lists, strings) with every secret-named key's text replaced by ``***``
    and every other text masked (:func:`mask`)."""
    if isinstance(value, dict):
        # A secret is a text; a list or dict under a secret-looking name (run.secret_names) is looked into.
        return {k: (MASK if isinstance(k, str) and isinstance(v, str) and v and is_secret_name(k, extra)
                    else mask_values(v, extra)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(mask_values(v, extra) for v in value)
    return mask(value, extra) if isinstance(value, str) else value


def recorded_config(cfg_json: dict) -> dict:
    """A config (as JSON) as it may be recorded (a checkpoint's manifest): every secret masked,
    and ``scaling.env_vars`` by its names only, each value ``***`` whatever its name. The
    config still validates; a resume compares no ``scaling`` field (``checkpoint.compat``)."""
    names = ((cfg_json.get("run") or {}).get("secret_names") or []) if isinstance(cfg_json, dict) else []
    out = mask_values(cfg_json, names)
    scaling = out.get("scaling") if isinstance(out, dict) else None
    if isinstance(scaling, dict) and isinstance(scaling.get("env_vars"), dict):
        out["scaling"] = {**scaling, "env_vars": {k: MASK for k in scaling["env_vars"]}}
    return out


# -- the environment's secrets, handed to the run's actors by call, not by runtime_env ----------

def split_env(env: Mapping[str, str], extra: Iterable[str] = ()) -> tuple[dict[str, str], dict[str, str]]:
    """``(plain, secret)``: ``env``'s secret-named variables (:func:`is_secret_name`) apart from
    the others. The plain ones may go through Ray's runtime_env (listed by ``ray list actors
    --detail``); the secret ones go by an actor's constructor argument (:func:`install`)."""
    extra = list(extra)
    # A value that carries a credential (a proxy's or a database's user:password@) is secret
    # whatever its name.
    plain = {k: v for k, v in env.items() if not is_secret_name(k, extra) and mask(str(v)) == str(v)}
    return plain, {k: v for k, v in env.items() if k not in plain}


def install(env: Mapping[str, str] | None) -> None:
    """Set ``env`` (the secret variables handed over by call) into this process's environment,
    before anything reads storage. The credentials store (``ELASTIC_TRAINER_STORAGE_CREDENTIALS``)
    is merged with what this process has, not replaced."""
    for k, v in (env or {}).items():
        if k == "ELASTIC_TRAINER_STORAGE_CREDENTIALS" and os.environ.get(k):
            try:
                merged = {**json.loads(os.environ[k]), **json.loads(v)}
            except json.JSONDecodeError:
                merged = None
            if merged is not None:
                v = json.dumps(merged)
        os.environ[k] = v


def carrying(fn: Callable) -> Callable:
    """``fn`` taking the secret environment as its first argument, installed before it runs: for
    a Ray task that reads storage (a task inherits its caller's runtime_env, which holds no secret)."""
    def run(env: Mapping[str, str] | None, *args, **kwargs):
        install(env)
        return fn(*args, **kwargs)
    # Named as fn (Ray names the task after it), but not functools.wraps: Ray checks a call's
    # arguments against the signature inspect finds, which would be fn's, without ``env``.
    run.__name__, run.__qualname__, run.__module__, run.__doc__ = fn.__name__, fn.__qualname__, fn.__module__, fn.__doc__
    return run
