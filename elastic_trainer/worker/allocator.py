"""The memory allocator of CPU workers: jemalloc, which Ray ships, with freed memory kept for reuse.

A CPU worker's tensors come from the C library's ``malloc``. Under glibc's, a
rank with a sharded optimizer grew by 20-60 MB a step without end: its live
memory was lower than an unsharded rank's, and what grew was freed memory
glibc kept in its main heap and could not reuse (``mallinfo2`` after 16 steps:
351 MB in use, 725 MB free but kept; unsharded, 465 and 70;
``benchmarks/shard_memory.py --allocator system``). A sharded step
frees buffers of a bucket's size (the bucket's gradients under ZeRO-2, its
flat copy once reduce-scattered, gloo's copy of it inside
``reduce_scatter_tensor``) while backward is still allocating, and the holes
left do not fit what the next step asks for.

jemalloc keeps freed extents by size class and hands them out again, so the
resident set is the working set's peak, flat from the first steps. Its purging
is turned off (``dirty_decay_ms:-1``): with it on, the pages of every step's
buffers went back to the kernel and were faulted in again (2.7 M page faults
in 10 steps against 0.47 M, steps 25-40% slower). This is what CUDA's caching
allocator does for GPU tensors; a GPU worker's tensors do not live in
``malloc``, so GPU workers keep the system's allocator.

Ray's Linux wheels carry ``ray/core/libjemalloc.so`` for Ray's own processes.
The worker process is started with it in ``LD_PRELOAD`` (the only way to
replace ``malloc`` for a process); where it is missing the worker runs on the
system allocator and says so (``in_use``).

That preload goes in a runtime environment of the worker's own, and a process
with an environment of its own is not one of the idle processes Ray keeps
started: each worker is a new process (about 1 s more for a 5-step run's
start on 2 cores, 15% of the integration tests' time). Where the cluster's
own processes already start on jemalloc with these settings (its nodes were
started with ``node_env()`` in their environment, as a cluster this project
starts is), nothing is added and Ray's started processes serve
(``inherited``).
"""

from __future__ import annotations

import contextlib
import os

CHOICES = ("jemalloc", "system")
# Freed pages stay mapped for reuse (see the module docstring).
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def jemalloc_path() -> str | None:
    """Ray's bundled jemalloc on this machine, or None where this Ray has none (not Linux)."""
    import ray

    path = os.path.join(os.path.dirname(ray.__file__), "core", "libjemalloc.so")
    return path if os.path.exists(path) else None


def node_env(path: str | None = None) -> dict[str, str]:
    """The environment that starts a process on jemalloc with purging off; empty where this
    Ray has no jemalloc. Given to a Ray node at its start, every worker it starts inherits it."""
    path = path or jemalloc_path()
    return {"LD_PRELOAD": path, "MALLOC_CONF": JEMALLOC_CONF} if path else {}


@contextlib.contextmanager
def nodes_start_on(choice: str, uses_gpu: bool = False):
    """Within it, Ray nodes this process starts (a local cluster, test clusters) start every
    process on ``choice`` (``node_env()`` for CPU jemalloc, else nothing): their workers need no
    environment of their own for it. This process's environment is as before afterwards."""
    env = node_env() if choice == "jemalloc" and not uses_gpu else {}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def allocator_env(choice: str, uses_gpu: bool, path: str | None = None,
                  inherited: str | None = None) -> dict[str, str]:
    """Environment variables that start a worker on ``choice`` (``scaling.cpu_allocator``).

    ``inherited``: what the cluster's processes start on without them (``inherited()``, read
    in a process the cluster started). Empty where that is ``choice`` already, for GPU workers,
    and where no jemalloc is found (``path``: the library to preload; default
    ``jemalloc_path()``, which assumes every node has Ray installed where this one has).
    ``system`` on a cluster started on jemalloc clears the preload; otherwise it adds nothing
    (a preload of the nodes' own, not this module's, is left as it is)."""
    if choice not in CHOICES:
        raise ValueError(f"cpu_allocator {choice!r}: expected one of {', '.join(CHOICES)}")
    if uses_gpu or choice == inherited:
        return {}
    if choice == "system":
        return {"LD_PRELOAD": "", "MALLOC_CONF": ""} if inherited == "jemalloc" else {}
    return node_env(path)


def inherited() -> str | None:
    """What this process was started on, where it is one of ``CHOICES`` as ``allocator_env``
    sets it: ``jemalloc`` with purging off, or ``system`` with nothing preloaded; else None."""
    here = in_use()
    if here == "jemalloc":
        return "jemalloc" if os.environ.get("MALLOC_CONF") == JEMALLOC_CONF else None
    return "system" if not os.environ.get("LD_PRELOAD") else None


def in_use() -> str:
    """``jemalloc`` if this process has jemalloc mapped (it was preloaded), else ``system``."""
    try:
        with open("/proc/self/maps") as f:
            return "jemalloc" if any("libjemalloc" in line for line in f) else "system"
    except OSError:
        return "system"


if __name__ == "__main__":
    # For `env $(python -m elastic_trainer.worker.allocator) ray start ...`: a node whose processes
    # all start on jemalloc, so CPU workers need no environment of their own.
    print(" ".join(f"{k}={v}" for k, v in node_env().items()))
