"""Whether this machine can hold a lab, and if not, what it lacks."""

from __future__ import annotations

import os
import shutil

from . import cgroups


def missing() -> str | None:
    """None where a lab can be built here; else what is missing, in words."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, veth links, cgroups)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the lab needs `{tool}` (Debian's iproute2)"
    if cgroups.version() is None:
        return "the lab needs cgroups: v1 with the cpu, memory and freezer controllers, or v2 with cpu and memory"
    return None
