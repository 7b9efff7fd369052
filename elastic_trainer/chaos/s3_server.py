"""A real S3-compatible server for the tests and the fault campaign: moto in server mode on 127.0.0.1, with its
credentials enforced (a wrong key is refused as AWS would refuse it).

It runs on a thread of the test process; Ray's workers reach it over HTTP like any S3. Its
buckets live in this process, so a ``stop`` and a ``start`` on the same port keep them, as a
real server's restart keeps what it had stored.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from urllib.parse import quote

# moto reads this when it is imported: its first actions (the test user, its key and policy)
# need no credentials, every later one does.
_SETUP_ACTIONS = 3
os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = str(_SETUP_ACTIONS)

import boto3  # noqa: E402
import pyarrow.fs as pafs  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402

REGION = "us-east-1"
_USER: list[str] = []   # the access key and secret of the user every server of this process shares


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class S3Server:
    """``endpoint`` (host:port), a user's ``key`` and ``secret``; ``uri`` builds the URIs a user
    writes for such a server (``?endpoint_override=...&scheme=http``). ``host``: the address it
    listens on (loopback; a lab host's own address for a campaign on lab hosts)."""

    def __init__(self, host: str = "127.0.0.1"):
        logging.getLogger("werkzeug").setLevel(logging.ERROR)   # one line per request otherwise
        self.host = host
        self.port = _free_port(host)
        self._server: ThreadedMotoServer | None = None
        self.start()
        url = f"http://{self.endpoint}"
        if not _USER:
            # moto answers its first actions in a process without credentials, and keeps every
            # server's users in the process: a second server (a campaign beside the tests' own)
            # finds the user made by the first, and its key works there too.
            iam = boto3.client("iam", endpoint_url=url, region_name=REGION, aws_access_key_id="setup",
                               aws_secret_access_key="setup")
            iam.create_user(UserName="tests")
            key = iam.create_access_key(UserName="tests")["AccessKey"]
            iam.put_user_policy(UserName="tests", PolicyName="everything", PolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
            _USER.extend([key["AccessKeyId"], key["SecretAccessKey"]])
        self.key, self.secret = _USER
        self.client = boto3.client("s3", endpoint_url=url, region_name=REGION, aws_access_key_id=self.key,
                                   aws_secret_access_key=self.secret)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        """Serve (again) on the same port, with what was stored before."""
        if self._server is None:
            self._server = ThreadedMotoServer(ip_address=self.host, port=self.port, verbose=False)
            self._server.start()

    def stop(self) -> None:
        """Stop answering: connections are refused until ``start``."""
        if self._server is not None:
            self._server.stop()
            self._server = None

    def bucket(self, name: str) -> str:
        """A new, empty bucket ``name``."""
        self.client.create_bucket(Bucket=name)
        return name

    def uri(self, bucket: str, path: str = "", secret: str | None = None, **options) -> str:
        """``s3://bucket/path?endpoint_override=...&scheme=http``; ``secret``: written into the
        URI, as ``query`` (access_key=..&secret_key=..) or ``userinfo`` (KEY:SECRET@bucket)."""
        query = {"endpoint_override": self.endpoint, "scheme": "http", **options}
        host = bucket
        # A secret is URL-encoded, as in any URI (AWS secrets hold '+' and '/').
        if secret == "query":
            query.update(access_key=self.key, secret_key=quote(self.secret, safe=""))
        elif secret == "userinfo":
            host = f"{self.key}:{quote(self.secret, safe='')}@{bucket}"
        tail = f"/{path.strip('/')}" if path else ""
        return f"s3://{host}{tail}?" + "&".join(f"{k}={v}" for k, v in query.items())

    def fs(self) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(access_key=self.key, secret_key=self.secret, endpoint_override=self.endpoint,
                                 scheme="http", region=REGION)

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """Every object under ``prefix``: key -> bytes."""
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                out[o["Key"]] = self.client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
        return out
