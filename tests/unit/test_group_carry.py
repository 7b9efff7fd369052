"""A re-plan carries a group whose members are the same, in the same order, into the new world.

Five real processes on loopback, no Ray: a dp=2 x pp=2 plan on workers
10-13, then worker 13 is gone and worker 14 joins a dp=2 x pp=2 plan whose
ranks are dealt out anew. Only replica 0's pipeline group (workers 10, 11)
has the same members in the same order; it comes across under new global
ranks, and the other three groups are built.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

from elastic_trainer.controller.run.group_carry import count_groups, keep_for, plan_keys, whole_groups
from elastic_trainer.controller.failures.stuck_steps import stuck
from elastic_trainer.parallel.topology import Topology
from elastic_trainer.worker.process_group import free_port

TOPO = Topology(2, 2)
PLAN_A = {0: 10, 1: 11, 2: 12, 3: 13}
PLAN_B = {0: 12, 1: 14, 2: 10, 3: 11}   # replica 0 of plan A is replica 1 here


def _sums(groups, rank: int) -> dict:
    import torch
    import torch.distributed as dist

    out = {}
    for role in ("dp", "pp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=getattr(groups, role))
        out[role] = t.item()
    # Point to point by global rank, as the pipeline addresses its peers.
    replica, stage = TOPO.coords(rank)
    t = torch.tensor([float(rank)])
    if stage == 0:
        dist.send(t, dst=TOPO.rank(replica, 1), group=groups.pp)
    else:
        dist.recv(t, src=TOPO.rank(replica, 0), group=groups.pp)
        out["received"] = t.item()
    return out


def _worker(wid: int, ports: tuple[int, int], states, out) -> None:
    import torch

    from elastic_trainer.worker.group_keeper import GroupKeeper

    keeper = GroupKeeper(f"worker {wid}")
    cpu = torch.device("cpu")
    try:
        if wid in PLAN_A.values():
            rank = {w: r for r, w in PLAN_A.items()}[wid]
            groups, how, carried = keeper.join("gloo", "127.0.0.1", ports[0], TOPO, rank, 30, 30, None, cpu,
                                               keys=plan_keys(TOPO, PLAN_A)[rank])
            out.put(("A", wid, carried, _sums(groups, rank)))
            states.put((wid, keeper.state(busy=False)))
            if wid == 13:
                return
        rank = {w: r for r, w in PLAN_B.items()}[wid]
        keys = plan_keys(TOPO, PLAN_B)[rank]
        keep = out_keep(wid, keys)
        keeper.leave({role: keys[role] for role in keep})
        groups, how, carried = keeper.join("gloo", "127.0.0.1", ports[1], TOPO, rank, 30, 30, None, cpu, keys=keys)
        out.put(("B", wid, carried, _sums(groups, rank)))
    except BaseException as e:  # noqa: BLE001 - the test reports it
        out.put(("error", wid, repr(e), None))
    finally:
        # os._exit skips the queues' feeder threads: flush both first, or what worker 13 put
        # before leaving can be lost.
        for q in (states, out):
            q.close()
            q.join_thread()
        os._exit(0)


def out_keep(wid: int, keys: dict) -> list[str]:
    # What the controller decides from plan A's states (the whole groups), computed here the same
    # way: plan A's four groups are all whole (no step ran), and worker 13 is gone.
    states = {w: {"busy": False, "held": {"dp": [plan_keys(TOPO, PLAN_A)[r]["dp"], 1],
                                          "pp": [plan_keys(TOPO, PLAN_A)[r]["pp"], 2]}}
              for r, w in PLAN_A.items() if w != 13}
    whole = whole_groups(states)
    rank = {w: r for r, w in PLAN_B.items()}[wid]
    return keep_for({rank: keys}, whole)[rank]


def test_the_group_with_the_same_members_in_the_same_order_is_carried_under_new_ranks():
    ctx = multiprocessing.get_context("fork")
    out, states = ctx.Queue(), ctx.Queue()
    ports = (free_port("127.0.0.1"), free_port("127.0.0.1"))
    procs = [ctx.Process(target=_worker, args=(w, ports, states, out)) for w in (10, 11, 12, 13, 14)]
    for p in procs:
        p.start()
    try:
        got = [out.get(timeout=90) for _ in range(8)]
        held = dict(states.get(timeout=30) for _ in range(4))
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)
    errors = [g for g in got if g[0] == "error"]
    assert not errors, errors
    a = {wid: (carried, sums) for phase, wid, carried, sums in got if phase == "A"}
    b = {wid: (carried, sums) for phase, wid, carried, sums in got if phase == "B"}
    assert all(carried == [] for carried, _ in a.values())
    # After plan A, with no step in flight, every member reports each group at one count.
    assert whole_groups(held) == {(role, tuple(m)) for r in PLAN_A for role, m in plan_keys(TOPO, PLAN_A)[r].items()}
    assert {w: c for w, (c, _) in b.items()} == {12: [], 14: [], 10: ["pp"], 11: ["pp"]}
    rank_b = {w: r for r, w in PLAN_B.items()}
    for wid, (_, sums) in b.items():
        replica, stage = TOPO.coords(rank_b[wid])
        assert sums["dp"] == sum(TOPO.dp_group_ranks(stage)), (wid, sums)
        assert sums["pp"] == sum(TOPO.pp_group_ranks(replica)), (wid, sums)
        if stage == 1:
            assert sums["received"] == TOPO.rank(replica, 0), (wid, sums)
    keys_b = plan_keys(TOPO, PLAN_B)
    counted = count_groups(keys_b, {rank_b[w]: c for w, (c, _) in b.items()})
    assert counted == {"groups_carried": 1, "groups_built": 3}


def test_a_busy_member_or_one_lost_leaves_its_groups_to_be_built_again():
    keys = plan_keys(TOPO, PLAN_A)

    def state(r, busy=False, pp_seq=5):
        return {"busy": busy, "held": {"dp": [keys[r]["dp"], 3], "pp": [keys[r]["pp"], pp_seq]}}

    every = {w: state(r) for r, w in PLAN_A.items()}
    assert len(whole_groups(every)) == 4
    # Worker 11 is still inside a step: none of its groups is whole.
    busy = {**every, 11: state(1, busy=True)}
    assert whole_groups(busy) == {("dp", (10, 12)), ("pp", (12, 13))}
    # Worker 10 issued one more operation on its pipeline group than worker 11 (it waits in it).
    ahead = {**every, 10: state(0, pp_seq=6)}
    assert ("pp", (10, 11)) not in whole_groups(ahead) and ("dp", (10, 12)) in whole_groups(ahead)
    # Worker 13 is lost (no answer): its two groups go.
    lost = {**every, 13: TimeoutError("no answer")}
    assert whole_groups(lost) == {("dp", (10, 12)), ("pp", (10, 11))}


def test_stuck_is_a_rank_blocked_in_a_whole_group_on_an_operation_its_idle_peers_never_issued():
    keys = plan_keys(TOPO, PLAN_A)

    def state(r, busy=False, waiting=None, dp_seq=3, pp_seq=5, roles=("dp", "pp")):
        seqs = {"dp": dp_seq, "pp": pp_seq}
        return {"busy": busy, "waiting": waiting, "held": {k: [keys[r][k], seqs[k]] for k in roles}}

    # Worker 13 was lost; the first cut let 11 go of dp (11, 13) and 12 of pp (12, 13); both left
    # their steps. Worker 10 waits in pp (10, 11) for an operation 11 never issued.
    left = {10: state(0, busy=True, waiting="pp", pp_seq=6), 11: state(1, roles=("pp",)),
            12: state(2, roles=("dp",))}
    assert stuck(left) == {10}
    # Not while 11 is still in its step (it may yet issue it), nor where 11 issued as many.
    assert stuck({**left, 11: state(1, busy=True, roles=("pp",))}) == set()
    assert stuck({**left, 10: state(0, busy=True, waiting="pp", pp_seq=5)}) == set()
    # Nor while 10 computes (no known wait), or waits in a group it no longer holds (cut: it ends).
    assert stuck({**left, 10: state(0, busy=True, pp_seq=6)}) == set()
    assert stuck({**left, 10: state(0, busy=True, waiting="pp", pp_seq=6, roles=("dp",))}) == set()
    # Blocked in the gradients' all-reduce on dp (10, 12), one collective ahead of idle 12.
    assert stuck({**left, 10: state(0, busy=True, waiting="dp", dp_seq=4)}) == {10}
    # A pipeline group of more than two stages: counts differ by stage, so never read stuck.
    members = [20, 21, 22, 23]
    four = {w: {"busy": w == 20, "waiting": "pp" if w == 20 else None, "held": {"pp": [members, 9 if w == 20 else 4]}}
            for w in members}
    assert stuck(four) == set()


def test_survivors_keep_their_ranks_where_the_layout_stays():
    from elastic_trainer.controller.run.group_carry import sticky_ranks

    assert sticky_ranks(TOPO, TOPO, PLAN_A, [10, 11, 12, 14, 15]) == {0: 10, 1: 11, 2: 12, 3: 14}
    assert sticky_ranks(Topology(4, 1), TOPO, PLAN_A, [10, 11, 12, 14]) is None   # the stages changed
    assert sticky_ranks(TOPO, TOPO, PLAN_A, [10, 11, 12]) is None                 # too few workers
    # Fewer replicas: the replica that survived whole (workers 12, 13) stays one, stages in order.
    three = {0: 10, 1: 11, 2: 12, 3: 13, 4: 14, 5: 15}
    assert sticky_ranks(TOPO, Topology(3, 2), three, [11, 12, 13, 15]) == {0: 12, 1: 13, 2: 11, 3: 15}
    assert sticky_ranks(Topology(1, 2), Topology(3, 2), three, [10, 13, 15]) is None   # none whole
