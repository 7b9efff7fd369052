"""Storage on a real S3 server (moto, on 127.0.0.1): credentials out of the config and masked
wherever a URI is shown, the corpus streamed, checkpoints and weights written and read, and
wrong credentials, a missing bucket or a server that does not answer told at once."""

import json
import os
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch

from elastic_trainer import Trainer
from elastic_trainer.checkpoint.durable import DurableStore
from elastic_trainer.checkpoint.resume_lookup import load_resume
from elastic_trainer.checkpoint.weights import load_weights, save_weights
from elastic_trainer.config import DataSection, TrainerConfig
from elastic_trainer.data.dataset import TokenDataset
from elastic_trainer.data.sampler import GlobalSampler
from elastic_trainer.errors import ConfigError
from elastic_trainer.storage.retry import StorageError, transient
from elastic_trainer.storage.credentials import ENV, CredentialsConflict, storage_env
from elastic_trainer.storage.filesystems import StorageConfigError, open_fs
from elastic_trainer.storage.preflight import check_storage
from elastic_trainer.storage.uris import location, mask, split_secrets

from ..conftest import tiny_config

MiB = 1 << 20


def fresh(s3) -> str:
    return s3.bucket(f"b-{uuid.uuid4().hex[:12]}")


def test_secrets_come_out_of_both_uri_forms_and_are_masked_in_text():
    uri = "s3://bkt/run?endpoint_override=h:9000&scheme=http&access_key=AK&secret_key=S3CR3T&session_token=TOK"
    clean, creds = split_secrets(uri)
    assert clean == "s3://bkt/run?endpoint_override=h:9000&scheme=http"
    assert creds == {"access_key": "AK", "secret_key": "S3CR3T", "session_token": "TOK"}
    assert split_secrets("s3://AK:S3CR3T@bkt/run")[0] == "s3://bkt/run"
    assert split_secrets("s3://AK:S3CR3T@bkt/run")[1] == {"access_key": "AK", "secret_key": "S3CR3T"}
    assert location(uri) == location("s3://bkt/other?endpoint_override=h:9000") == "s3://h:9000/bkt"
    line = f"writing {uri} failed; also s3://AK:S3CR3T@bkt/x"
    assert "S3CR3T" not in mask(line) and "TOK" not in mask(line) and "secret_key=***" in mask(line)
    assert split_secrets("/local/path") == ("/local/path", {}) and mask("/a/b@c") == "/a/b@c"


def test_a_config_never_holds_a_secret(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    cfg = TrainerConfig.model_validate({
        "data": {"path": "s3://AK:S3CR3T@corpus/tokens?endpoint_override=h:1&scheme=http"},
        "checkpoint": {"storage": "s3://ck/runs?endpoint_override=h:1&scheme=http&secret_key=OTHER&access_key=K2"},
    })
    dumped = json.dumps(cfg.model_dump(mode="json"))
    assert "S3CR3T" not in dumped and "OTHER" not in dumped
    assert cfg.data.path == "s3://corpus/tokens?endpoint_override=h:1&scheme=http"
    kept = json.loads(os.environ[ENV])
    assert kept["s3://h:1/corpus"] == {"access_key": "AK", "secret_key": "S3CR3T"}
    assert kept["s3://h:1/ck"] == {"secret_key": "OTHER", "access_key": "K2"}
    assert ENV in storage_env()
    with pytest.raises(CredentialsConflict, match="different credentials") as e:
        TrainerConfig.model_validate({"data": {"path": "s3://A:ONE@b/x"}, "eval": {"path": "s3://A:TWO@b/y"}})
    assert "ONE" not in str(e.value) and "TWO" not in str(e.value)
    with pytest.raises(ConfigError) as e:   # a validation error shows what was given: masked
        TrainerConfig.from_dict({"data": {"path": "x"}, "run": {"output_dir": ["s3://bkt/o?secret_key=S3CR3T"]}})
    assert "S3CR3T" not in str(e.value)


def test_options_in_an_s3_uri_are_checked_and_named():
    with pytest.raises(StorageConfigError, match=r"unknown option 'endpoint'.*endpoint_override") as e:
        open_fs("s3://b/x?endpoint=h:1&secret_key=S3CR3T", "checkpoint.storage")
    assert "S3CR3T" not in str(e.value) and "checkpoint.storage" in str(e.value)
    with pytest.raises(StorageConfigError, match="request_timeout='soon' is not a number of seconds"):
        open_fs("s3://b/x?request_timeout=soon")
    with pytest.raises(StorageConfigError, match="names no bucket"):
        open_fs("s3:///x")


def test_wrong_credentials_and_a_missing_bucket_are_told_before_anything_starts(s3):
    bucket = fresh(s3)
    wrong = s3.uri(bucket, "ck").replace("?", f"?access_key={s3.key}&secret_key=WRONGSECRET&", 1)
    with pytest.raises(StorageConfigError) as e:
        check_storage([("checkpoint.storage", wrong)], retries=3)
    said = str(e.value)
    assert "checkpoint.storage" in said and "WRONGSECRET" not in said and "secret_key=***" in said
    assert "SIGNATURE_DOES_NOT_MATCH" in said or "ACCESS_DENIED" in said, said
    with pytest.raises(StorageConfigError, match="NO_SUCH_BUCKET") as e:
        check_storage([("run.output_dir", s3.uri("no-such-bucket", "out", secret="query"))], retries=3)
    assert s3.secret not in str(e.value)
    check_storage([("data.path", s3.uri(bucket, "nothing/yet", secret="query")), ("x", "/local")], retries=0)


def test_a_run_with_wrong_credentials_or_no_bucket_stops_before_ray_starts(s3, corpus_dir, monkeypatch):
    bucket = fresh(s3)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    was = ray.is_initialized()
    wrong = s3.uri(bucket, "ck").replace("?", f"?access_key={s3.key}&secret_key=WRONGSECRET&", 1)
    for storage, answer in ((wrong, "SIGNATURE_DOES_NOT_MATCH|ACCESS_DENIED"),
                            (s3.uri("missing-bucket", "ck", secret="query"), "NO_SUCH_BUCKET")):
        cfg = TrainerConfig.from_dict(tiny_config(corpus_dir, checkpoint={"storage": storage, "durable_every": 2}))
        with pytest.raises(StorageConfigError, match=rf"checkpoint.storage\(.*({answer})") as e:
            Trainer(cfg, verbose=False).fit()
        assert "WRONGSECRET" not in str(e.value) and s3.secret not in str(e.value)
        assert ray.is_initialized() == was


def test_a_servers_refusal_is_not_retried_and_a_dropped_connection_is(s3):
    fs, _ = open_fs(s3.uri("no-such-bucket", "x", secret="query"))
    with pytest.raises(OSError) as refused:
        fs.get_file_info(pa.fs.FileSelector("no-such-bucket/x"))
    assert not transient(refused.value)
    fs, path = open_fs("s3://b/x?endpoint_override=127.0.0.1:1&scheme=http&connect_timeout=1&access_key=a&secret_key=b")
    with pytest.raises(OSError) as down:
        fs.get_file_info(path)
    assert transient(down.value)


def test_durable_checkpoints_on_s3_commit_prune_and_resume(s3, monkeypatch):
    monkeypatch.setattr("elastic_trainer.storage.retry.time.sleep", lambda s: None)
    bucket = fresh(s3)
    uri = s3.uri(bucket, "ck", secret="query")
    store = DurableStore(uri, run_id="r1")
    rng = np.random.default_rng(0)
    for step in (10, 20, 30):
        part = {"step": step, "blocks": [0], "extra": {}, "comm": {},
                "params": {"blocks.0.w": rng.standard_normal((64, 64)).astype(np.float32)},
                "optim": {"blocks.0.w": {"exp_avg": np.zeros((64, 64), np.float32), "step": np.float32(step)}}}
        store.save(step, [part], {"run_name": "demo"})
        store.prune(keep=2)
    keys = s3.objects(bucket, "ck/")
    assert sorted({k.split("/")[1] for k in keys if not k.endswith("/")}) == ["step-00000020-r1", "step-00000030-r1"]
    assert all(s3.secret not in v.decode("latin-1") for v in keys.values())   # manifests included
    resumed = load_resume(DurableStore(uri), "demo")
    assert resumed.manifest["step"] == 30 and np.array_equal(resumed.shards[0]["params"]["blocks.0.w"], part["params"]["blocks.0.w"])
    # A listing that fails is an error, never "no checkpoints here": --resume must not start afresh.
    s3.stop()
    try:
        with pytest.raises(StorageError) as e:
            load_resume(DurableStore(uri, retries=1, backoff_s=0.01), "demo")
        assert s3.secret not in str(e.value)
    finally:
        s3.start()


def test_the_corpus_streams_from_s3_within_its_read_ahead(s3, tmp_path):
    bucket = fresh(s3)
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 50000, int(n), dtype=np.int32) for n in rng.integers(64, 600, 1500)]
    stream = np.concatenate(rows).astype(np.int64)
    fs = s3.fs()
    for f in range(3):
        part = rows[f * 500:(f + 1) * 500]
        with fs.open_output_stream(f"{bucket}/corpus/p{f}.parquet") as out:
            pq.write_table(pa.table({"tokens": pa.array(part, type=pa.list_(pa.int32()))}), out, row_group_size=50)
    seq = 127
    ref = stream[: len(stream) // (seq + 1) * (seq + 1)].reshape(-1, seq + 1)
    ds = TokenDataset.open(DataSection(path=s3.uri(bucket, "corpus", secret="userinfo"), seq_len=seq,
                                       read_ahead_mb=1))
    assert len(ds) == len(ref) and s3.secret not in json.dumps(ds.fingerprint())
    sampler, gb = GlobalSampler(len(ds), seed=5, block=64, mix=2), 32
    for step in range(len(ds) // gb):
        idx = sampler.rows(step * gb, gb)
        x, y = ds.sample(idx)
        ds.prefetch(sampler.rows((step + 1) * gb, gb))
        assert (x == ref[idx, :-1]).all() and (y == ref[idx, 1:]).all()
    assert 0 < ds.peak_bytes <= MiB, "ranged reads of row groups, within data.read_ahead_mb"
    ds.close()


def test_weights_go_to_s3_and_load_back(s3):
    bucket = fresh(s3)
    state = {"a.weight": torch.randn(8, 4), "b.bias": torch.randn(4)}
    where = s3.uri(bucket, "out/run", secret="query")
    path = save_weights(where, state, {"step": "3"})
    assert s3.secret not in path
    back = load_weights(path)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert any(k.startswith("out/run/") for k in s3.objects(bucket, "out/"))
