"""One rank of an all-reduce sweep across lab hosts: ``python _lab_sweep.py RANK PROCS MASTER PORT MAX_BYTES OUT``.

Started on each host by ``_lab_comm.calibrate`` (in the host's namespace, over
its capped link): the ranks meet at ``MASTER:PORT`` and run
``calibration.sweep`` (ring, tree, chunked, and the all-gather and all-to-all the int8 and
top-k codecs send; 1 KiB to ``MAX_BYTES``); rank 0
writes the rows to ``OUT``.
"""

from __future__ import annotations

import os
import sys


def main(rank: int, procs: int, master: str, port: int, max_bytes: int, out: str) -> None:
    from elastic_trainer.planning import calibration, cost_model

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")   # the host's link, not loopback
    calibration.sweep_rank(rank, procs, f"tcp://{master}:{port}", "gloo", cost_model.size_range(1 << 10, max_bytes),
                           ("ring", "tree", "chunked", "allgather", "alltoall"), iters=3, warmup=1, timeout_s=600,
                           out_path=out)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), a[2], int(a[3]), int(a[4]), a[5])
