"""A rank whose join failed half-way must be able to join the next plan."""

import datetime

import torch.distributed as dist

from elastic_trainer.parallel.topology import Topology
from elastic_trainer.worker.process_group import destroy_groups, free_port, init_groups


def test_a_failed_join_does_not_change_the_next_groups_name():
    # Rank 0 of a world of 2 whose peer never comes: the join times out after
    # init_process_group has already named the group.
    port = free_port("127.0.0.1")
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    try:
        dist.init_process_group("gloo", store=store, world_size=2, rank=0,
                                timeout=datetime.timedelta(seconds=1))
    except Exception:
        pass
    else:  # pragma: no cover - the join cannot succeed without rank 1
        raise AssertionError("a join without its peer succeeded")
    assert not dist.is_initialized() and dist.get_pg_count() > 0
    destroy_groups()
    assert dist.get_pg_count() == 0
    # The next join names its default group as a fresh process would.
    groups = init_groups("gloo", "127.0.0.1", free_port("127.0.0.1"), Topology(1, 1), 0, timeout_s=5)
    try:
        assert dist.get_world_size() == 1 and groups.dp is not None
    finally:
        destroy_groups()
    assert dist.get_pg_count() == 0


def test_the_store_serves_on_the_address_the_ranks_dial_in_its_family():
    import os
    import socket

    from elastic_trainer.worker.process_group import _listener

    port = free_port("127.0.0.1")
    fd = _listener("127.0.0.1", port, 32)
    with socket.socket(fileno=os.dup(fd)) as s:
        # IPv4, not every interface in IPv6: a peer arrives as 127.0.0.1, not ::ffff:127.0.0.1,
        # whose lookup no hosts file answers.
        assert s.family == socket.AF_INET and s.getsockname() == ("127.0.0.1", port)
    master = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False, master_listen_fd=fd)
    peer = dist.TCPStore("127.0.0.1", port, 2, is_master=False, wait_for_workers=False)
    peer.set("arrived", "1")
    assert master.get("arrived") == b"1"
    del peer, master
    # The store closed its socket: the port can serve the next plan.
    os.close(_listener("127.0.0.1", port, 2))
