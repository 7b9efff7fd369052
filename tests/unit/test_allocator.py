"""The CPU workers' allocator (worker.allocator): which environment starts a worker on jemalloc, and a
process started with it really runs on it, with its purging off."""

import os
import subprocess
import sys

import pytest

from elastic_trainer.config import TrainerConfig
from elastic_trainer.worker import allocator
from elastic_trainer.worker.allocator import JEMALLOC_CONF, allocator_env, in_use, jemalloc_path

# Run in a fresh interpreter: what it prints is the allocator it runs on, then jemalloc's own
# reading of its decay options (ssize_t; -1: never purge).
_PROBE = """
import ctypes
from elastic_trainer.worker.allocator import in_use
print(in_use())
if in_use() == "jemalloc":
    lib = ctypes.CDLL(None)
    for opt in (b"opt.dirty_decay_ms", b"opt.muzzy_decay_ms"):
        v, n = ctypes.c_ssize_t(), ctypes.c_size_t(ctypes.sizeof(ctypes.c_ssize_t))
        assert lib.mallctl(opt, ctypes.byref(v), ctypes.byref(n), None, 0) == 0
        print(v.value)
"""


def _probe(env: dict) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=60, check=True)
    assert "Invalid conf" not in out.stderr and "cannot be preloaded" not in out.stderr, out.stderr
    return out.stdout.split()


def test_the_default_is_jemalloc_for_cpu_workers_and_nothing_for_gpu_or_system():
    assert TrainerConfig.from_dict({"data": {"path": "x"}}).scaling.cpu_allocator == "jemalloc"
    env = allocator_env("jemalloc", uses_gpu=False, path="/opt/lib/libjemalloc.so")
    assert env == {"LD_PRELOAD": "/opt/lib/libjemalloc.so", "MALLOC_CONF": JEMALLOC_CONF}
    assert allocator_env("jemalloc", uses_gpu=True, path="/opt/lib/libjemalloc.so") == {}
    assert allocator_env("system", uses_gpu=False, path="/opt/lib/libjemalloc.so") == {}
    with pytest.raises(ValueError, match="tcmalloc.*jemalloc, system"):
        allocator_env("tcmalloc", uses_gpu=False)


def test_no_jemalloc_here_leaves_the_system_allocator(monkeypatch):
    monkeypatch.setattr(allocator, "jemalloc_path", lambda: None)
    assert allocator_env("jemalloc", uses_gpu=False) == {}


def test_a_bad_choice_in_the_config_names_the_choices():
    with pytest.raises(ValueError, match="jemalloc.*system"):
        TrainerConfig.from_dict({"data": {"path": "x"}, "scaling": {"cpu_allocator": "tcmalloc"}})


@pytest.mark.skipif(jemalloc_path() is None, reason="this Ray ships no jemalloc (not Linux)")
def test_a_process_started_with_the_env_runs_on_jemalloc_without_purging():
    assert _probe(allocator_env("jemalloc", uses_gpu=False)) == ["jemalloc", "-1", "-1"]
    assert _probe({}) == ["system"]
    assert in_use() == "system"   # this test process was started plainly
