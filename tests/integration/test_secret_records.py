"""A secret given in the storage URIs, in a --resume-from URI and in scaling.env_vars reaches none of
the run's records: its output and Ray's logs, its events and results, the manifests and weights in
the bucket, the report folder, ``status``, and the actors as Ray lists them to any client."""

import glob
import json
import os
import uuid
from urllib.parse import quote

import pytest
import ray
from ray.core.generated import gcs_pb2

from elastic_trainer import Trainer
from elastic_trainer.cli.status import format_status, live_statuses
from elastic_trainer.errors import ElasticTrainerError

from .test_s3_runs import config, leaks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def actor_table() -> str:
    """Every actor of the cluster as the GCS gives it to a client: the records `ray list actors
    --detail` and the dashboard show (runtime_env included) are fields of these."""
    accessor = ray._private.state.state._connect_and_get_accessor()
    return "\n".join(str(gcs_pb2.ActorTableData.FromString(a)) for a in accessor.get_actor_table(None, None))


def test_secrets_in_uris_a_resume_uri_and_env_vars_reach_no_record(cluster, s3, corpus_dir, tmp_path, capfd):
    tag = uuid.uuid4().hex[:10]
    token, dsn, plain = f"tok-{tag}", f"dsn-{tag}", f"plain-{tag}"
    bucket = s3.bucket(f"secret-records-{tag}")   # a location no earlier run's credentials name
    reports = tmp_path / "reports"
    cfg = config(corpus_dir, "secretrun", 4, parallel={"dp": 2, "pp": 1},
                 checkpoint={"durable_every": 2, "storage": s3.uri(bucket, "ckpt", secret="query")},
                 run={"output_dir": s3.uri(bucket, "out", secret="userinfo"), "report_dir": str(reports),
                      "secret_names": ["ET_TEST_DSN"]},
                 scaling={"env_vars": {"ET_TEST_API_TOKEN": token, "ET_TEST_DSN": dsn, "ET_TEST_PLAIN": plain}})
    seen: dict[str, str] = {}

    def look(rec):   # while the run's actors live: what status and Ray's actor listing show
        if rec["step"] == 2 and not seen:
            seen["status"] = "\n".join(format_status(s) for s in live_statuses("secretrun"))
            seen["actors during the run"] = actor_table()

    first = Trainer(cfg, verbose=True, on_step=look).fit()
    assert first.finished and "secretrun" in seen["status"]
    # The workers reached the bucket with the credentials they were handed by call.
    keys = s3.objects(bucket)
    assert any(k.startswith(f"ckpt/step-00000004-{first.run_id}/") for k in keys)

    # Resumed by its path, the credentials written into it.
    def with_secret(uri: str) -> str:
        return uri.replace("s3://", f"s3://{s3.key}:{quote(s3.secret, safe='')}@", 1)

    resumed = Trainer(cfg.with_overrides(["train.steps=6"]), verbose=True).fit(
        resume=with_secret(first.durable_path), accept_change="train.steps")
    assert resumed.finished and [r["step"] for r in resumed.history] == list(range(1, 7))
    # A path to no checkpoint: the error names it, without its secret.
    missing = with_secret(first.durable_path.replace("step-00000004-", "step-00000099-"))
    with pytest.raises(ElasticTrainerError) as e:
        Trainer(cfg.with_overrides(["train.steps=8"]), verbose=True).fit(resume=missing)
    said = str(e.value)
    assert "step-00000099" in said, said

    out = capfd.readouterr()
    actors = actor_table()
    # The listing is the one that would show them: the plain variable's value is there.
    assert plain in seen["actors during the run"] and "secretrun-controller" in actors
    texts = {"stdout": out.out, "stderr": out.err, "error": said,
             "error's events": json.dumps(getattr(e.value, "events", []), default=str),
             "results": json.dumps([[r.history, r.events, r.workers, r.plans, r.plan, r.model_path, r.durable_path]
                                    for r in (first, resumed)], default=str),
             "actors after the runs": actors, **seen}
    texts.update({f"s3://{bucket}/{k}": v.decode("latin-1") for k, v in s3.objects(bucket).items()})
    texts.update({str(p): open(p, "rb").read().decode("latin-1")
                  for p in glob.glob(f"{reports}/**", recursive=True) if os.path.isfile(p)})
    assert any(p.endswith("secretrun.png") for p in texts)
    logs = ray._private.worker._global_node.get_logs_dir_path()
    texts.update({p: open(p, "rb").read().decode("latin-1") for p in glob.glob(f"{logs}/**", recursive=True)
                  if os.path.isfile(p)})
    assert any("/worker-" in p for p in texts) and any(k.endswith("manifest.json") for k in texts)
    assert [w for secret in (s3.secret, token, dsn) for w in leaks(secret, texts)] == []
