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
