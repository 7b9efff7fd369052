"""A worker vouches for its node-mates from /proc: running, stopped, or unknown (never running by mistake)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from elastic_trainer.worker.liveness import process_mark, running

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")


def _state_settles(pid, mark, want, timeout=5.0):
    end = time.monotonic() + timeout
    while running(pid, mark) != want and time.monotonic() < end:
        time.sleep(0.02)
    return running(pid, mark)


def test_a_running_stopped_and_gone_process_read_as_such():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mark = process_mark(p.pid)
        assert mark is not None and running(p.pid, mark) is True
        os.kill(p.pid, signal.SIGSTOP)
        assert _state_settles(p.pid, mark, False) is False
        os.kill(p.pid, signal.SIGCONT)
        assert _state_settles(p.pid, mark, True) is True
    finally:
        p.kill()
        p.wait()
    # Reaped: its pid names nothing now (or, reused, another process): unknown, not running.
    assert running(p.pid, mark) is None


def test_another_process_on_the_same_pid_is_unknown():
    me = os.getpid()
    assert running(me, process_mark()) is True
    assert running(me, "0") is None


def test_a_hung_worker_is_killed_by_its_pid_and_start_time_never_by_its_pid_alone():
    # kill_hung ran os.kill(pid) on the node: a worker that ended meanwhile left its pid to another
    # process, which it took.
    import subprocess
    import sys

    from elastic_trainer.worker.liveness import kill_marked, process_mark

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mark = process_mark(child.pid)
        assert mark is not None
        other = str(int(mark) - 1)      # the start time of an earlier process on that pid
        assert kill_marked(child.pid, other) == "gone"
        assert child.poll() is None     # the process that holds the pid now is left alone
        assert kill_marked(child.pid, mark) == "killed"
        assert child.wait(timeout=10) == -9
        assert kill_marked(child.pid, mark) == "gone"
    finally:
        if child.poll() is None:
            child.kill()
