import os

# Keep Ray on loopback: with this unset to 0, Ray binds 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# The S3 client asks the EC2 metadata address (169.254.169.254) for credentials it was not given:
# the tests' traffic stays on loopback.
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
# Ray nodes started by the tests inherit this, so workers can import tests.helpers factories.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)

import shutil
import tempfile

import pytest

from elastic_trainer.data.corpus import prepare_stdlib_corpus

SEQ_LEN = 16
# Every run saves its weights: the tests' go under one temporary folder, not the working directory.
# Made when first asked for: a process that only imports this module (a spawned child unpickling
# a test's function) would leave an empty one behind.
_WEIGHTS_DIR: list[str] = []


def weights_dir() -> str:
    if not _WEIGHTS_DIR:
        _WEIGHTS_DIR.append(tempfile.mkdtemp(prefix="et-test-weights-"))
    return _WEIGHTS_DIR[0]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> str:
    """A small real corpus: 256 KiB of stdlib source as rows of SEQ_LEN + 1 bytes."""
    out = tmp_path_factory.mktemp("corpus") / "stdlib"
    prepare_stdlib_corpus(out, SEQ_LEN, max_bytes=256 << 10)
    return str(out)


@pytest.fixture(scope="session")
def s3():
    """A real S3 server on 127.0.0.1 (``tests.s3_server``); a test that stops it starts it again."""
    from tests.s3_server import S3Server   # imports moto only where a test asks for it

    server = S3Server()
    yield server
    server.stop()


def tiny_config(corpus: str, **sections) -> dict:
    """A config dict for a GPT small enough to step in milliseconds; sections override by key."""
    cfg = {
        "run": {"log_every": 1000, "report_dir": None},
        "output_dir": None,
        "model": {"kind": "gpt", "n_layer": 6, "n_head": 2, "d_model": 32},
        "data": {"path": corpus, "seq_len": SEQ_LEN},
        "train": {"steps": 5, "global_batch_size": 8, "micro_batch_size": 1, "lr": 1e-3, "seed": 1,
                  "grad_clip": 1.0},
        "parallel": {"dp": 1, "pp": 1},
        "scaling": {"placement_timeout_s": 60},
        "comm": {"timeout_s": 60},
    }
    del cfg["output_dir"]
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    if "output_dir" not in cfg["run"] and not cfg.get("checkpoint", {}).get("storage"):
        cfg["run"]["output_dir"] = os.path.join(weights_dir(), cfg["run"].get("name") or "run")
    return cfg


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


def pytest_unconfigure(config):
    for d in _WEIGHTS_DIR:   # the runs' weights: nothing of the tests stays behind
        shutil.rmtree(d, ignore_errors=True)
    # After the summary, leave without the interpreter's teardown: one full run in several
    # died there with SIGSEGV (rc 139) after every test had passed, in native threads of the
    # libraries the tests load (Ray, torch). The exit status stays pytest's own.
    if _EXIT_STATUS:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
