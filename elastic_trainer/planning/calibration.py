"""Measure the all-reduce algorithms on this machine and fit the alpha-beta model to them.

Besides the all-reduces, the sweep times the backend's all-gather and
all-to-all (``allgather``, ``alltoall``): the int8 and top-k codecs send
through those, and a backend need not run them at the ring's pace (on the
lab's capped links int8's exchange took 3x the ring's prediction). Their
fits price those codecs (``sync_cost``); busbw is ``algbw * (p-1)/p`` there.

:func:`sweep` times every algorithm at every size on a process group, the
way nccl-tests reports: ``algbw = size / time`` and, for an all-reduce,
``busbw = algbw * 2(p-1)/p``, the per-link bandwidth a ring would need for
that time, comparable across ``p`` and against the link's peak.
:func:`run_sweep` starts ``procs`` local processes (gloo over TCP on
127.0.0.1, one torch thread each) that run :func:`sweep`;
:func:`fit_constants` turns its rows into ``alpha``/``beta`` per algorithm;
:func:`loopback_throughput` measures what one plain TCP stream over loopback
moves, the ceiling a bus bandwidth on this machine can be held against.
:func:`constants_document` packs all three into the JSON that
``elastic-trainer plan --constants`` reads (see ``constants.load_constants``).

The parameter server is not measured: its pushes and pulls go through Ray
actors, which this sweep does not start. Its constants are the ring's, which
``cost_model.predict("ps", ...)`` combines with the push/pull byte pattern;
the document says so (``"derived_from": "ring"``).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import socket
import statistics
import tempfile
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import cost_model
from ..comm.algorithms import ALGORITHMS, get_algorithm
from ..comm.stats import CommStats
from ..comm.timing import start_timer

# A loopback stream this long runs for well over the connection's slow start.
LOOPBACK_BYTES = 256 << 20
_LOOPBACK_CHUNK = 1 << 20

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: ``4096``, ``1KiB``, ``64K``, ``256MiB``, ``1G`` (binary units, case-insensitive)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"size {text!r} is not a number of bytes with an optional unit "
                         f"(e.g. 4096, 1KiB, 64K, 256MiB, 1G)")
    return int(float(m.group(1)) * _UNITS[unit])


def _allgather(buf: torch.Tensor, group, stats: CommStats) -> None:
    """The all-gather the int8 and top-k codecs send: each rank's ``1/p`` of ``buf`` to every rank."""
    p = dist.get_world_size(group)
    width = max(1, buf.numel() // p)
    out = list(torch.empty(p * width, dtype=buf.dtype, device=buf.device).view(p, width).unbind(0))
    dist.all_gather(out, buf[:width], group=group)


def _alltoall(buf: torch.Tensor, group, stats: CommStats) -> None:
    """The all-to-all the int8 codec sends: ``1/p`` of ``buf`` to each rank."""
    p = dist.get_world_size(group)
    n = max(1, buf.numel() // p) * p
    src = buf[:n] if buf.numel() >= n else torch.ones(n, dtype=buf.dtype, device=buf.device)
    dist.all_to_all_single(torch.empty_like(src), src, group=group)


_EXCHANGES = {"allgather": _allgather, "alltoall": _alltoall}
SWEPT = ALGORITHMS + tuple(_EXCHANGES)   # what a sweep can time


def _bus_factor(name: str, p: int) -> float:
    """busbw / algbw as nccl-tests reports it: ``2(p-1)/p`` for an all-reduce, ``(p-1)/p`` for an exchange."""
    return (p - 1) / p * (1 if name in _EXCHANGES else 2)


def _timed(name: str):
    return _EXCHANGES[name] if name in _EXCHANGES else get_algorithm(name)


def sweep(group=None, sizes: Sequence[int] | None = None, algorithms: Sequence[str] = ("ring", "tree", "chunked"),
          iters: int = 5, warmup: int = 1, device: torch.device | str = "cpu") -> list[dict]:
    """Time each all-reduce algorithm (or exchange: ``allgather``, ``alltoall``) at each size on
    ``group``; every member must call it.

    Each timed iteration starts after a barrier; a row's time is the median
    over ``iters`` of this rank's times, then the maximum over ranks (the
    slowest rank is when the step can go on), so every rank returns the same
    rows: ``algorithm, size, count, p, time_s, algbw, busbw`` (bandwidths
    in bytes/s). ``sizes`` default to :func:`size_range` (1 KiB .. 256 MiB). ``device``: where
    the buffers live (CUDA times come from events, see ``comm.timing``).
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"sweep needs iters >= 1 and warmup >= 0; got iters={iters}, warmup={warmup}")
    fns = [(name, _timed(name)) for name in algorithms]
    p = dist.get_world_size(group)
    rows = []
    for name, fn in fns:
        for size in cost_model.size_range() if sizes is None else sizes:
            count = max(1, size // 4)
            buf = torch.ones(count, device=device)
            times = []
            for i in range(warmup + iters):
                dist.barrier(group=group)
                timer = start_timer(buf.device)
                fn(buf, group, CommStats())
                if i >= warmup:
                    times.append(timer.stop().seconds())
            slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
            t = slowest.item()
            algbw = count * 4 / t if t > 0 else math.inf
            rows.append({"algorithm": name, "size": count * 4, "count": count, "p": p, "time_s": t,
                         "algbw": algbw, "busbw": algbw * _bus_factor(name, p)})
    return rows


def format_table(rows: Sequence[dict]) -> str:
    """The rows of :func:`sweep` as an nccl-tests style table (us, GB/s), one block per algorithm."""
    out = []
    for name in dict.fromkeys(r["algorithm"] for r in rows):
        block = [r for r in rows if r["algorithm"] == name]
        out.append(f"# all_reduce  algorithm: {name}  ranks: {block[0]['p']}")
        out.append(f"#{'size':>11} {'count':>13} {'type':>7} {'redop':>6} {'time':>10} {'algbw':>8} {'busbw':>8}")
        out.append(f"#{'(B)':>11} {'(elements)':>13} {'':>7} {'':>6} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8}")
        for r in block:
            out.append(f" {r['size']:>11} {r['count']:>13} {'float':>7} {'sum':>6} {r['time_s'] * 1e6:>10.2f} "
                       f"{r['algbw'] / 1e9:>8.3f} {r['busbw'] / 1e9:>8.3f}")
    return "\n".join(out)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sweep_worker(rank: int, procs: int, port: int, backend: str, sizes: list[int], algorithms: list[str],
                  iters: int, warmup: int, timeout_s: float, out_path: str) -> None:
    # Loopback, so the sweep measures what loopback_throughput does; set here, not in the caller's process.
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sweep_rank(rank, procs, f"tcp://127.0.0.1:{port}", backend, sizes, algorithms, iters, warmup, timeout_s,
               out_path)


def sweep_rank(rank: int, procs: int, init_method: str, backend: str, sizes: Sequence[int],
               algorithms: Sequence[str], iters: int, warmup: int, timeout_s: float, out_path: str) -> None:
    """One of ``procs`` processes of a sweep (local, or one a host): join the group at
    ``init_method``, run :func:`sweep`; rank 0 writes the rows to ``out_path`` as JSON."""
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=procs,
                            timeout=_dt.timedelta(seconds=timeout_s))
    try:
        rows = sweep(None, sizes, algorithms, iters=iters, warmup=warmup)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(rows, f)
        # Nobody leaves while a peer may still need it for the last collective.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _join(ctx, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s; give it a longer timeout_s "
                                   "or fewer/smaller sizes")
    except Exception:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        raise


def run_sweep(procs: int, sizes: Sequence[int] | None = None, algorithms: Sequence[str] = ALGORITHMS,
              iters: int = 5, backend: str = "gloo", *, warmup: int = 1, timeout_s: float = 900.0) -> list[dict]:
    """Run :func:`sweep` on ``procs`` local processes and return its rows (rank 0's).

    Processes are spawned fresh (``torch.multiprocessing``), meet over TCP on a
    free 127.0.0.1 port, and use one torch thread each; gloo is pinned to the
    loopback interface unless ``GLOO_SOCKET_IFNAME`` says otherwise, so the
    numbers compare with :func:`loopback_throughput`. ``sizes`` default to
    ``cost_model.size_range()`` (1 KiB .. 256 MiB). The whole sweep must end
    within ``timeout_s``, else the processes are killed and ``TimeoutError``
    is raised.
    """
    import torch.multiprocessing as mp

    if procs < 2:
        raise ValueError(f"run_sweep needs procs >= 2 to have anything to all-reduce; got procs={procs}")
    if iters < 1 or warmup < 0:
        raise ValueError(f"run_sweep needs iters >= 1 and warmup >= 0; got iters={iters}, warmup={warmup}")
    unknown = [a for a in algorithms if a not in SWEPT]
    if unknown or not algorithms:
        raise ValueError(f"run_sweep algorithms must be a non-empty subset of {', '.join(SWEPT)}; "
                         f"got {list(algorithms)}")
    sizes = cost_model.size_range() if sizes is None else [int(s) for s in sizes]
    bad = [s for s in sizes if s < 4]
    if not sizes or bad:
        raise ValueError(f"run_sweep sizes must be >= 4 bytes (one float); got {sizes}")
    with tempfile.TemporaryDirectory(prefix="et-bench-") as tmp:
        out_path = os.path.join(tmp, "rows.json")
        ctx = mp.start_processes(
            _sweep_worker, nprocs=procs, join=False, start_method="spawn",
            args=(procs, _free_port(), backend, sizes, list(algorithms), iters, warmup, timeout_s, out_path))
        _join(ctx, timeout_s, f"the {procs}-process sweep")
        with open(out_path) as f:
            return json.load(f)


def fit_constants(rows: Sequence[dict], relative: bool = True) -> dict[str, dict]:
    """Fit ``alpha``/``beta`` per algorithm in ``rows`` (from :func:`run_sweep`), plus ``ps`` from ring's.

    Each entry: ``alpha_s``, ``beta_s_per_byte``, ``bandwidth_Bps`` (``1/beta``),
    ``relative_residual`` (RMS of ``(measured - predicted) / measured`` when
    ``relative``), ``p`` and ``samples``. The fit weighs every size alike
    (``relative``) so the latency of small messages counts as much as the
    bandwidth of big ones. ``ps`` has the ring's numbers and
    ``"derived_from": "ring"``: it is not measured.
    """
    out: dict[str, dict] = {}
    for name in dict.fromkeys(r["algorithm"] for r in rows):
        block = [r for r in rows if r["algorithm"] == name]
        ps = {r["p"] for r in block}
        if len(ps) != 1:
            raise ValueError(f"rows of {name!r} mix rank counts {sorted(ps)}; fit one sweep at a time")
        p = ps.pop()
        f = cost_model.fit([(r["size"], r["time_s"]) for r in block], name, p, relative=relative)
        out[name] = {"alpha_s": f.alpha, "beta_s_per_byte": f.beta, "bandwidth_Bps": f.bandwidth,
                     "relative_residual" if relative else "residual_s": f.residual, "p": p, "samples": len(block)}
    if "ring" in out:
        out["ps"] = {**out["ring"], "derived_from": "ring"}
    return out


# The sender runs as plain Python (no torch, no package import), so it starts in milliseconds.
_SENDER = """
import socket, sys
port, nbytes, chunk = map(int, sys.argv[1:4])
buf = memoryview(bytearray(chunk))
with socket.create_connection(("127.0.0.1", port)) as s:
    left = nbytes
    while left > 0:
        n = min(left, chunk)
        s.sendall(buf[:n])
        left -= n
    s.recv(1)  # the receiver's word that all of it arrived
"""


def loopback_throughput(nbytes: int = LOOPBACK_BYTES, repeats: int = 3, chunk: int = _LOOPBACK_CHUNK,
                        timeout_s: float = 120.0) -> dict:
    """Bytes/s of one TCP stream over 127.0.0.1 between two processes: ``{"bytes_per_s", "runs_Bps", ...}``.

    A child process sends ``nbytes`` in ``chunk``-byte writes; this process
    receives and times from the accepted connection to the last byte.
    ``bytes_per_s`` is the best of ``repeats`` streams: the limit, not the
    typical run. A ring all-reduce's busbw is the per-link rate it achieved,
    so it is held against this number.
    """
    import subprocess
    import sys

    if nbytes < chunk or repeats < 1 or chunk < 1:
        raise ValueError(f"loopback_throughput needs nbytes >= chunk >= 1 and repeats >= 1; got nbytes={nbytes}, "
                         f"chunk={chunk}, repeats={repeats}")
    view = memoryview(bytearray(chunk))
    runs = []
    for _ in range(repeats):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen(1)
            srv.settimeout(timeout_s)
            proc = subprocess.Popen([sys.executable, "-c", _SENDER, str(srv.getsockname()[1]), str(nbytes),
                                     str(chunk)])
            try:
                conn, _ = srv.accept()
                with conn:
                    conn.settimeout(timeout_s)
                    got, t0 = 0, time.perf_counter()
                    while got < nbytes:
                        n = conn.recv_into(view, min(chunk, nbytes - got))
                        if n == 0:
                            raise RuntimeError(f"the loopback sender closed after {got} of {nbytes} bytes")
                        got += n
                    dt = time.perf_counter() - t0
                    conn.sendall(b"k")
            finally:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        runs.append(nbytes / dt)
    return {"bytes_per_s": max(runs), "runs_Bps": runs, "nbytes": nbytes, "chunk": chunk}


def constants_document(rows: Sequence[dict], fits: dict[str, dict], loopback: dict | None, *, procs: int,
                       backend: str, command: str | None = None) -> dict:
    """The JSON ``elastic-trainer bench-comm --out`` writes and ``plan --constants`` reads."""
    return {
        "kind": "elastic_trainer.comm_constants",
        "version": 1,
        "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "procs": procs,
        "backend": backend,
        "sizes": sorted({r["size"] for r in rows}),
        "loopback_Bps": None if loopback is None else loopback["bytes_per_s"],
        "algorithms": fits,
    }


def format_fits(fits: dict[str, dict], loopback_Bps: float | None = None) -> str:
    """One line per fitted algorithm: alpha (us), bandwidth (GB/s), residual, and bandwidth vs loopback."""
    out = [f"#{'algorithm':>10} {'alpha(us)':>10} {'beta(ns/B)':>11} {'bw(GB/s)':>9} {'resid':>7}"
           + (f" {'bw/loopback':>12}" if loopback_Bps else "")]
    for name, f in fits.items():
        bw = f["bandwidth_Bps"]
        resid = f.get("relative_residual", f.get("residual_s", math.nan))
        line = (f" {name:>10} {f['alpha_s'] * 1e6:>10.2f} {f['beta_s_per_byte'] * 1e9:>11.4f} "
                f"{bw / 1e9:>9.3f} {resid:>7.3f}")
        if loopback_Bps:
            line += f" {bw / loopback_Bps:>12.2f}"
        if f.get("derived_from"):
            line += f"   (not measured: {f['derived_from']}'s constants with the parameter-server byte pattern)"
        out.append(line)
    return "\n".join(out)


def peak_busbw(rows: Sequence[dict]) -> dict[str, float]:
    """The highest busbw (bytes/s) each algorithm reached in ``rows``."""
    out: dict[str, float] = {}
    for r in rows:
        out[r["algorithm"]] = max(out.get(r["algorithm"], 0.0), r["busbw"])
    return out
