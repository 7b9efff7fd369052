"""Whether this machine can hold a lab, and if not, what it lacks."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

from . import cgroups

_PROBE = "etlabprobe"


@functools.lru_cache(maxsize=1)
def missing() -> str | None:
    """None where a lab can be built here; else what is missing, in words. Tried for real: a
    network namespace and a cgroup are made and removed (a container may have the tools and
    still refuse them)."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, veth links, cgroups)"
    for tool in ("ip", "tc", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"the lab needs `{tool}` (Debian's iproute2 and util-linux)"
    v = cgroups.version()
    if v is None:
        return "the lab needs cgroups: v1 with the cpu, memory and freezer controllers, or v2 with cpu and memory"
    made = subprocess.run(["ip", "netns", "add", _PROBE], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", _PROBE], capture_output=True)
    if made.returncode != 0:
        return f"this machine refuses network namespaces: {made.stderr.strip()}"
    probe = (cgroups.ROOT / "cpu" / _PROBE) if v == 1 else (cgroups.ROOT / _PROBE)
    try:
        probe.mkdir(exist_ok=True)
        probe.rmdir()
    except OSError as e:
        return f"this machine refuses new cgroups ({probe}): {e}"
    return None
