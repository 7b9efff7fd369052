"""The lab's hosts for these tests: 4 worker hosts and a head, each a network namespace and a
cgroup on this machine (``lab/``), one Ray cluster across them, shared by the tests.

Skipped where the machine cannot hold a lab (``lab.missing``: root, iproute2, cgroups).
"""

import pytest

from lab import Lab, missing, sweep

WORKER_HOSTS = 4
# The quotas leave room for the head and the test's own process on this 2-core machine. The
# head runs the driver and the controller, whose start-up (imports, at 0.4 of a core about 6 s
# each) every run waits for before its workers are placed.
CPUS_PER_HOST = 0.4
HEAD_CPUS = 1.0


class SharedLab:
    """One lab for the package's tests. A handover gives the next test every host with a live
    Ray node again: a host a test killed, froze or cut off has its processes killed (what is
    left of them) and its node started anew."""

    def __init__(self):
        self.lab: Lab | None = None

    def get(self) -> Lab:
        if self.lab is None:
            self.lab = Lab(hosts=WORKER_HOSTS + 1, cpus_per_host=CPUS_PER_HOST, head_cpus=HEAD_CPUS)
            self.lab.start_ray()
            return self.lab
        self.lab.revive()
        return self.lab

    def close(self) -> None:
        if self.lab is not None:
            self.lab.close()
            self.lab = None


@pytest.fixture(scope="package")
def shared_lab():
    why = missing()
    if why:
        pytest.skip(why)
    found = sweep()   # what an interrupted run left (a SIGKILL gives no teardown a chance)
    if any(found.values()):
        print(f"swept an earlier lab's leftovers: {found}")
    s = SharedLab()
    yield s
    s.close()


@pytest.fixture
def lab(shared_lab) -> Lab:
    return shared_lab.get()
