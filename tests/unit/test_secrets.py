"""One rule for secret names (S3's, GCS's, Azure's credentials, names that say so, the user's; any
case), the same in mask and split_secrets; configs recorded with env_vars by name only; secret
variables kept apart from what may go through a runtime_env."""

import json
import os

from urllib.parse import quote

import pytest

from elastic_trainer.checkpoint.compat import resume_check, resume_request
from elastic_trainer.config import TrainerConfig
from elastic_trainer.errors import ConfigError
from elastic_trainer.secrets import (carrying, install, is_secret_name, mask, mask_values, recorded_config,
                                     remember_names, split_env)
from elastic_trainer.storage.credentials import ENV, lookup, take_credentials
from elastic_trainer.storage.filesystems import StorageConfigError, _with_credentials, open_fs, s3_options
from elastic_trainer.storage.uris import split_secrets

from ..conftest import tiny_config

SECRET = "S3cr3t+/Val=="
ENCODED = quote(SECRET, safe="")   # as a URI carries it


@pytest.mark.parametrize("name", [
    # S3
    "access_key", "secret_key", "session_token", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
    # GCS
    "access_token", "credentials", "private_key", "client_secret", "GOOGLE_APPLICATION_CREDENTIALS",
    # Azure
    "account_key", "AccountKey", "sas_token", "sig", "SharedAccessSignature", "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_CLIENT_SECRET",
    # names that say so
    "HF_TOKEN", "MY_API_TOKEN", "WANDB_API_KEY", "apiKey", "db_password", "x-amz-security-token",
])
def test_credential_names_and_names_that_say_so_are_secret_in_any_case(name):
    assert is_secret_name(name) and is_secret_name(name.upper()) and is_secret_name(name.lower())


@pytest.mark.parametrize("name", ["tokens_per_s", "endpoint_override", "scheme", "region", "NCCL_SOCKET_IFNAME",
                                  "LD_PRELOAD", "GLOO_SOCKET_IFNAME", "AccountName", "sv", "se", "step", "loss"])
def test_ordinary_names_are_not(name):
    assert not is_secret_name(name)


def test_every_config_field_name_is_ordinary():
    # mask_values hides a secret-named key's text: no text field of the config may look like one
    # (run.secret_names, a list, is looked into).
    cfg = TrainerConfig.from_dict(tiny_config("/data")).model_dump(mode="json")
    assert [f"{s}.{k}" for s, keys in cfg.items() for k in keys if is_secret_name(k)] == ["run.secret_names"]
    assert mask_values({"run": {"secret_names": ["A_DSN"]}}) == {"run": {"secret_names": ["A_DSN"]}}


@pytest.mark.parametrize("text, kept", [
    (f"s3://b/p?endpoint_override=127.0.0.1:9000&ACCESS_KEY={SECRET}&Secret_Key={SECRET}&scheme=http",
     "endpoint_override=127.0.0.1:9000&ACCESS_KEY=***&Secret_Key=***&scheme=http"),
    (f"s3://KEY:{ENCODED}@bucket/p", "s3://***@bucket/p"),
    (f"gs://b/p?access_token={SECRET}", "gs://b/p?access_token=***"),
    (f"https://acc.blob.core.windows.net/c/x?sv=2022-11-02&ss=b&sig={SECRET}&se=2026",
     "sv=2022-11-02&ss=b&sig=***&se=2026"),
    (f"DefaultEndpointsProtocol=https;AccountName=acc;AccountKey={SECRET};EndpointSuffix=core.windows.net",
     "AccountName=acc;AccountKey=***;EndpointSuffix"),
    (f"abfs://c@acc.dfs.core.windows.net/p?account_key={SECRET}", "account_key=***"),
    (f"AWS_SECRET_ACCESS_KEY={SECRET} python train.py", "AWS_SECRET_ACCESS_KEY=*** python"),
    (json.dumps({"MY_API_TOKEN": SECRET, "NCCL_DEBUG": "INFO"}), '{"MY_API_TOKEN": "***", "NCCL_DEBUG": "INFO"}'),
    (repr({"client_secret": SECRET, "n": 1}), "{'client_secret': '***', 'n': 1}"),
    ('{"private_key": "-----BEGIN PRIVATE KEY-----\\nMIIE' + SECRET + '\\n-----END PRIVATE KEY-----\\n"}',
     '{"private_key": "***"}'),
    (f"-----BEGIN RSA PRIVATE KEY-----\nMIIE{SECRET}\n-----END RSA PRIVATE KEY-----", "***"),
])
def test_mask_hides_each_stores_secrets(text, kept):
    shown = mask(text)
    assert SECRET not in shown and ENCODED not in shown and kept in shown, shown


def test_mask_leaves_ordinary_text_as_it_is():
    for text in ("step 4 loss=2.31 tokens_per_s=812.5", "s3://b/ck?endpoint_override=h:9000&scheme=http",
                 "/a/b@c", "plan: dp=2 x pp=2", ""):
        assert mask(text) == text


def test_user_names_are_secret_once_given_or_remembered():
    assert mask(f"RUN_DSN={SECRET}") == f"RUN_DSN={SECRET}"
    assert mask(f"RUN_DSN={SECRET}", ["run_dsn"]) == "RUN_DSN=***"
    assert is_secret_name("Run_Dsn", ["RUN_DSN"])
    remember_names(["Other_Dsn"])
    assert is_secret_name("OTHER_DSN") and mask(f"other_dsn={SECRET}") == "other_dsn=***"


def test_split_secrets_takes_out_exactly_what_mask_hides_in_any_case():
    uri = (f"s3://b/p?endpoint_override=h:9000&Access_Key=AK&SECRET_KEY={ENCODED}&session_token=T&"
           f"api_token={ENCODED}&scheme=http")
    clean, creds = split_secrets(uri)
    assert creds == {"access_key": "AK", "secret_key": SECRET, "session_token": "T", "api_token": SECRET}
    assert clean == "s3://b/p?endpoint_override=h:9000&scheme=http"
    masked = mask(uri)
    assert all(f"{k}=***" in masked for k in ("Access_Key", "SECRET_KEY", "session_token", "api_token"))
    assert "endpoint_override=h:9000" in masked and "scheme=http" in masked


def test_a_recorded_config_holds_env_vars_by_name_and_still_resumes():
    run = {"name": "r", "secret_names": ["MY_DSN"]}
    given = TrainerConfig.from_dict(tiny_config(
        "/data", run=run, scaling={"env_vars": {"NCCL_DEBUG": "INFO", "MY_DSN": SECRET, "HF_TOKEN": SECRET}},
        model={"kind": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32})).model_dump(mode="json")
    recorded = recorded_config(given)
    assert SECRET not in json.dumps(recorded)
    assert recorded["scaling"]["env_vars"] == {"NCCL_DEBUG": "***", "MY_DSN": "***", "HF_TOKEN": "***"}
    assert recorded["model"] == given["model"] and recorded["train"] == given["train"]
    TrainerConfig.model_validate(recorded)   # what export and resume read back still validates
    # A resume compares no scaling field: the same names are accepted, and so is a changed value
    # (not detectable from the checkpoint; docs/storage.md).
    assert resume_check(recorded, given, None, None, step=2) == ([], [])


def test_mask_values_hides_secret_keys_at_any_depth():
    shown = mask_values({"a": [{"Password": SECRET, "user": "u"}], "uri": f"s3://k:{ENCODED}@b/p", "n": 3})
    assert shown == {"a": [{"Password": "***", "user": "u"}], "uri": "s3://***@b/p", "n": 3}


def test_split_env_keeps_secret_variables_apart():
    env = {"NCCL_DEBUG": "INFO", "LD_PRELOAD": "/lib/j.so", "AWS_SECRET_ACCESS_KEY": SECRET,
           ENV: "{}", "MY_DSN": SECRET, "HF_TOKEN": SECRET}
    plain, secret = split_env(env, ["my_dsn"])
    assert plain == {"NCCL_DEBUG": "INFO", "LD_PRELOAD": "/lib/j.so"}
    assert set(secret) == {"AWS_SECRET_ACCESS_KEY", ENV, "MY_DSN", "HF_TOKEN"}


def test_install_merges_the_credentials_store_and_carrying_installs_first(monkeypatch):
    monkeypatch.setenv(ENV, json.dumps({"s3://h:1/a": {"access_key": "A"}}))
    monkeypatch.delenv("ET_TEST_TOKEN", raising=False)
    install({ENV: json.dumps({"s3://h:1/b": {"access_key": "B"}})})
    assert lookup("s3://b/x?endpoint_override=h:1") == {"access_key": "B"}
    assert lookup("s3://a/x?endpoint_override=h:1") == {"access_key": "A"}

    def reads(name):
        return os.environ.get(name)

    assert carrying(reads)({"ET_TEST_TOKEN": SECRET}, "ET_TEST_TOKEN") == SECRET
    assert carrying(reads).__name__ == "reads"
    monkeypatch.delenv("ET_TEST_TOKEN")


def test_a_resume_uri_loses_its_credentials_before_anything_records_it(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    target = f"s3://KEY:{SECRET.replace('/', '%2F').replace('+', '%2B')}@bkt/ck/step-00000004-abc?endpoint_override=h:7"
    req = resume_request(target, (), None)
    assert req["target"] == "s3://bkt/ck/step-00000004-abc?endpoint_override=h:7"
    assert lookup(req["target"]) == {"access_key": "KEY", "secret_key": SECRET}
    with pytest.raises(ConfigError) as e:
        resume_request(target, "model.d_model", None)
    assert SECRET not in str(e.value)


def test_an_s3_uri_with_another_stores_credential_is_refused_masked():
    with pytest.raises(StorageConfigError) as e:
        s3_options(f"s3://b/p?endpoint_override=h:1&SAS_Token={ENCODED}")
    said = str(e.value)
    assert "SAS_Token" in said and ENCODED not in said and SECRET not in said, said


def test_an_azure_uri_opens_with_the_key_its_config_no_longer_holds(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    local = "blob_storage_authority=127.0.0.1:1&dfs_storage_authority=127.0.0.1:1&enable_tls=false&tenant_id=t&client_id=c"
    given = f"abfs://acc:{ENCODED}@c/p?{local}&client_secret={ENCODED}"
    clean = take_credentials(given)
    assert clean == f"abfs://c/p?{local}" and SECRET not in mask(os.environ[ENV])
    # from_uri reads an account key in the user part, a client secret in the query: put back there.
    back = _with_credentials(clean)
    assert back.startswith(f"abfs://acc:{ENCODED}@c/p?") and split_secrets(back) == split_secrets(given)
    assert type(open_fs(clean)[0]).__name__ == "AzureFileSystem"


def test_a_trackers_config_holds_env_vars_by_name():
    from elastic_trainer.trackers.records import flat_config

    given = TrainerConfig.from_dict(tiny_config("/data", scaling={"env_vars": {"HF_TOKEN": SECRET, "A_DSN": SECRET}},
                                                run={"secret_names": ["A_DSN"]})).model_dump(mode="json")
    flat = flat_config(given, 200)
    assert flat["scaling.env_vars.HF_TOKEN"] == "***" and flat["scaling.env_vars.A_DSN"] == "***"
    assert SECRET not in json.dumps(flat)


@pytest.mark.parametrize("text", [
    'path="s3://b/p?secret_key=S3CR3T"', '{"path": "gs://b/o?access_token=S3CR3T"}',
    "uri=s3://b/x?secret_key=S3CR3T&y=1", "input_value='https://a.blob/c?sv=1&sig=S3CR3T'"])
def test_a_secret_inside_an_ordinary_names_value_is_masked(text):
    # The value of a name that is no secret (path, uri, a pydantic input_value) is looked into.
    assert "S3CR3T" not in mask(text) and "***" in mask(text)


def test_an_env_value_carrying_a_credential_is_secret_whatever_its_name():
    plain, secret = split_env({"HTTPS_PROXY": "http://user:pw@proxy:3128", "NCCL_DEBUG": "INFO",
                               "DATABASE_URL": "postgres://u:p@db/x"})
    assert plain == {"NCCL_DEBUG": "INFO"} and set(secret) == {"HTTPS_PROXY", "DATABASE_URL"}
