"""Part of ``benchmarks/scale.py --durable``: durable checkpoints to local disk and to a local S3
server, in interleaved runs, each write's seconds and bytes from its ``durable_checkpoint`` event."""

from __future__ import annotations

import os
import shutil
import tempfile


def durable_runs(size: tuple[int, int], args, rounds: int, size_config, fit) -> dict:
    """Durable checkpoints at ``size`` to local disk and to S3, ``rounds`` interleaved runs each:
    per target the writes' seconds and bytes (``durable_checkpoint`` events)."""
    from tests.s3_server import S3Server

    server = S3Server()
    bucket = server.bucket("bench-durable")
    os.environ.update(AWS_ACCESS_KEY_ID=server.key, AWS_SECRET_ACCESS_KEY=server.secret,
                      AWS_EC2_METADATA_DISABLED="true")
    local = tempfile.mkdtemp(prefix="et-bench-durable-")
    out: dict = {"local": [], "s3": []}
    try:
        for i in range(rounds):
            for target, storage in (("local", f"{local}/r{i}"), ("s3", server.uri(bucket, f"r{i}"))):
                print(f"{size[0]}x{size[1]}: durable checkpoints to {target}, round {i + 1}/{rounds} ...",
                      flush=True)
                ck = {"memory_every": 10, "durable_every": 10, "storage": storage}
                raw = size_config(*size, 30, f"scale-durable-{target}{i}", args, ck)
                res = fit(raw)["result"]
                out[target] += [{"step": e["step"], "seconds": e["seconds"], "bytes": e["bytes"]}
                                for e in res.events if e["kind"] == "durable_checkpoint"]
    finally:
        shutil.rmtree(local, ignore_errors=True)
        server.stop()
    return out
