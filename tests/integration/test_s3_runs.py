"""Runs whose corpus, durable checkpoints and weights live on a real S3 server (moto, on
127.0.0.1): a node lost and a resume from the bucket, the server gone for seconds and for good,
and the secret given in the URIs found in none of the run's records or output."""

import glob
import json
import os
import threading
from urllib.parse import quote

import pyarrow.fs as pafs
import pytest
import ray

from elastic_trainer import Trainer, TrainerConfig
from elastic_trainer.checkpoint.weights import load_weights
from elastic_trainer.controller.state.saving import SaveError

from ..conftest import tiny_config
from .test_recovery import FAST_FAILURE, Chaos, node_of_rank

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def upload(s3, local_dir: str, bucket: str, prefix: str) -> None:
    pafs.copy_files(local_dir, f"{bucket}/{prefix}", source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=s3.fs())


def config(corpus, name, steps, failure=None, **sections) -> TrainerConfig:
    sections["checkpoint"] = {"memory_every": 1, **sections.get("checkpoint", {})}
    return TrainerConfig.from_dict(tiny_config(
        corpus, run={"name": name, **sections.pop("run", {})}, train={"steps": steps},
        failure={**FAST_FAILURE, **(failure or {})}, comm={"timeout_s": 20}, **sections))


def steps_of(result, kind):
    return [e["step"] for e in result.events if e["kind"] == kind]


def leaks(secret: str, texts: dict[str, str]) -> list[str]:
    """Where ``secret`` (as given, or URL-encoded as the URIs carry it) appears."""
    forms = {secret, quote(secret, safe="")}
    return [where for where, text in texts.items() if any(f in text for f in forms)]


def test_a_run_on_s3_loses_a_node_resumes_from_the_bucket_and_records_no_secret(
        fresh_cluster, s3, corpus_dir, tmp_path, capfd):
    c, nodes = fresh_cluster(4)
    bucket = s3.bucket("demo-run")
    upload(s3, corpus_dir, bucket, "corpus")
    reports = tmp_path / "reports"
    cfg = config(s3.uri(bucket, "corpus", secret="userinfo"), "s3demo", 20,
                 parallel={"dp": 2, "pp": 2},
                 checkpoint={"durable_every": 10, "storage": s3.uri(bucket, "ckpt", secret="query")},
                 run={"output_dir": s3.uri(bucket, "out/s3demo", secret="query"), "report_dir": str(reports)})
    assert s3.secret not in json.dumps(cfg.model_dump(mode="json"))

    def kill():
        c.remove_node(node_of_rank("s3demo", 3, nodes), allow_graceful=False)

    result = Trainer(cfg, verbose=True, on_step=Chaos().at(12, kill)).fit()
    assert result.finished and len(result.recoveries) == 1
    assert steps_of(result, "durable_checkpoint") == [10, 20]
    keys = s3.objects(bucket)
    assert {k.split("/")[1] for k in keys if k.startswith("ckpt/step-")} == {
        f"step-{s:08d}-{result.run_id}" for s in (10, 20)}
    # The weights are in the bucket, in the sharded layout, and load.
    assert result.model_path.startswith(f"s3://{bucket}/out/s3demo")
    weights = load_weights(result.model_path)
    assert any(k.startswith("out/s3demo/") and k.endswith(".safetensors") for k in keys)
    assert len(weights) == len(load_weights(result.model_path))

    resumed = Trainer(cfg.with_overrides(["train.steps=24"]), verbose=True).fit(
        resume=True, accept_change="train.steps")
    assert resumed.finished and resumed.run_id == result.run_id
    assert [r["step"] for r in resumed.history] == list(range(1, 25))   # the bucket's history, then 21-24
    [event] = [e for e in resumed.events if e["kind"] == "resume"]
    assert event["step"] == 20

    # The secret, given in three URIs, is in none of the run's records or output.
    out = capfd.readouterr()
    texts = {"stdout": out.out, "stderr": out.err,
             "result": json.dumps([result.history.to_dicts(), result.events.to_dicts(), result.workers, result.plans], default=str),
             "resumed": json.dumps([resumed.history.to_dicts(), resumed.events.to_dicts()], default=str)}
    texts.update({f"s3://{bucket}/{k}": v.decode("latin-1") for k, v in s3.objects(bucket).items()
                  if not k.startswith("corpus/")})
    texts.update({str(p): open(p, "rb").read().decode("latin-1") for p in glob.glob(f"{reports}/**", recursive=True)
                  if os.path.isfile(p)})
    logs = ray._private.worker._global_node.get_logs_dir_path()
    texts.update({p: open(p, "rb").read().decode("latin-1") for p in glob.glob(f"{logs}/worker-*")})
    assert len([p for p in texts if "/worker-" in p]) > 4
    assert leaks(s3.secret, texts) == []


def test_a_server_gone_for_seconds_is_waited_out_and_the_next_checkpoint_lands(cluster, s3, corpus_dir):
    bucket = s3.bucket("brief-outage")
    upload(s3, corpus_dir, bucket, "corpus")
    cfg = config(s3.uri(bucket, "corpus", secret="query"), "s3outage", 60, parallel={"dp": 2, "pp": 1},
                 checkpoint={"durable_every": 5, "storage": s3.uri(bucket, "ckpt", secret="query")},
                 run={"output_dir": s3.uri(bucket, "out", secret="query")})
    back = threading.Timer(5.0, s3.start)
    stopped_at: list[int] = []

    def outage():
        s3.stop()
        back.start()

    def mark(rec):
        if s3.running is False and not stopped_at:
            stopped_at.append(rec["step"])

    chaos = Chaos().at(8, outage)
    try:
        result = Trainer(cfg, verbose=False, on_step=lambda r: (chaos(r), mark(r))).fit()
    finally:
        back.join()
        s3.start()
    assert result.finished and result.step == 60
    landed = steps_of(result, "durable_checkpoint")
    assert landed and max(landed) == 60 and any(s > 8 for s in landed), landed
    assert load_weights(result.model_path)


def test_a_server_gone_for_good_ends_the_run_with_a_save_error_and_nothing_lost(cluster, s3, corpus_dir):
    bucket = s3.bucket("gone-for-good")
    # No retries of ours (the S3 client still tries 3 times): the run's end is not waited for.
    cfg = config(corpus_dir, "s3gone", 8, parallel={"dp": 2, "pp": 1}, failure={"storage_retries": 0},
                 checkpoint={"durable_every": 5, "storage": s3.uri(bucket, "ckpt", secret="query",
                                                                   connect_timeout=1, request_timeout=5)},
                 run={"output_dir": s3.uri(bucket, "out", secret="query", connect_timeout=1, request_timeout=5)})
    try:
        with pytest.raises(SaveError) as e:
            Trainer(cfg, verbose=False, on_step=Chaos().at(3, s3.stop)).fit()
    finally:
        s3.start()
    said = str(e.value)
    assert "fallback" in said or "kept" in said, said
    assert s3.secret not in said and quote(s3.secret, safe="") not in said
