"""The CPU workers' allocator (worker.allocator): which environment starts a worker on jemalloc, and a
process started with it really runs on it, with its purging off."""

import os
import subprocess
import sys

import pytest

from elastic_trainer.config import TrainerConfig
from elastic_trainer.worker import allocator
from elastic_trainer.worker.allocator import (JEMALLOC_CONF, allocator_env, in_use, inherited, jemalloc_path,
                                              nodes_start_on)

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


def test_a_cluster_started_on_the_choice_needs_no_environment_of_the_workers_own():
    lib = "/opt/lib/libjemalloc.so"
    # Nothing added: Ray's idle processes, started on it, serve as workers.
    assert allocator_env("jemalloc", uses_gpu=False, path=lib, inherited="jemalloc") == {}
    assert allocator_env("system", uses_gpu=False, path=lib, inherited="system") == {}
    # system on a cluster started on jemalloc: the preload is cleared.
    assert allocator_env("system", uses_gpu=False, path=lib, inherited="jemalloc") == {"LD_PRELOAD": "",
                                                                                       "MALLOC_CONF": ""}
    # A preload of the nodes' own (inherited None) is replaced for jemalloc, left as it is for system.
    assert allocator_env("jemalloc", uses_gpu=False, path=lib, inherited=None)["LD_PRELOAD"] == lib
    assert allocator_env("system", uses_gpu=False, path=lib, inherited=None) == {}


def test_inherited_reads_this_process(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert inherited() == "system"
    monkeypatch.setenv("LD_PRELOAD", "/opt/lib/libtcmalloc.so")   # set, but not loaded: someone else's
    assert inherited() is None
    monkeypatch.setattr(allocator, "in_use", lambda: "jemalloc")
    monkeypatch.setenv("MALLOC_CONF", JEMALLOC_CONF)
    assert inherited() == "jemalloc"
    monkeypatch.setenv("MALLOC_CONF", "dirty_decay_ms:10000")   # jemalloc with purging on: not ours
    assert inherited() is None


def test_nodes_start_on_sets_the_environment_only_within(monkeypatch):
    monkeypatch.setattr(allocator, "jemalloc_path", lambda: "/opt/lib/libjemalloc.so")
    monkeypatch.setenv("MALLOC_CONF", "narenas:2")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with nodes_start_on("jemalloc"):
        assert os.environ["LD_PRELOAD"] == "/opt/lib/libjemalloc.so" and os.environ["MALLOC_CONF"] == JEMALLOC_CONF
    assert "LD_PRELOAD" not in os.environ and os.environ["MALLOC_CONF"] == "narenas:2"
    for choice, gpu in (("system", False), ("jemalloc", True)):
        with nodes_start_on(choice, gpu):
            assert "LD_PRELOAD" not in os.environ


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
    # Cleared again for system where the parent's environment has it.
    cleared = allocator_env("system", uses_gpu=False, inherited="jemalloc")
    assert _probe({**allocator_env("jemalloc", uses_gpu=False), **cleared}) == ["system"]
