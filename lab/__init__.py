"""A lab of real hosts on one machine, for tests and benchmarks (not part of the package).

Each host is a network namespace with its own address from 198.18.0.0/15 on a
bridge the lab makes, and a cgroup with a CPU quota and a memory limit; each
runs a Ray node. Faults: a host killed, frozen and thawed, its link cut and
healed, its link's rate capped, its memory limit lowered. Needs root, ``ip``
and ``tc`` (iproute2), and cgroups (v1 with cpu, memory and freezer, or v2).
"""

from .hosts import Host, Lab, leftovers, sweep, wait_until
from .run import LabRun
from .support import missing

__all__ = ["Host", "Lab", "LabRun", "leftovers", "missing", "sweep", "wait_until"]
