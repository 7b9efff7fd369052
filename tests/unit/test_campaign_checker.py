"""The campaign's checker catches what it is for: a checkpoint with a block or a slice missing, a
history with a step twice, weights one ulp off where bit-identity is due, a restore from an
abandoned timeline, failures without a fault, something left running. And its schedules replay."""

import numpy as np
import pytest
import torch

from elastic_trainer.chaos.campaign.checker import (check_checkpoint, check_counts, check_drains, check_end,
                                                    check_goodput, check_history, check_leftovers, check_resumes,
                                                    check_state, check_timeline, steps_off_layout)
from elastic_trainer.checkpoint.state import merge_shards
from elastic_trainer.chaos.campaign.schedule import Fault, Schedule, covering, draw
from elastic_trainer.chaos.campaign.shrink import shrink
from elastic_trainer.controller.run.fault_points import POINTS, FaultPoints


def _history(steps, gb=8):
    return [{"step": s, "cursor": (s - 1) * gb, "plan": 0} for s in steps]


def test_a_history_with_a_step_twice_or_missing_is_caught():
    assert check_history(_history(range(1, 7)), 6, 8) == []
    [v] = [v for v in check_history(_history([1, 2, 3, 3, 4, 5, 6]), 6, 8) if v.invariant == "steps_once"]
    assert "twice: [3]" in v.detail
    [v] = check_history(_history([1, 2, 4, 5, 6]), 6, 8)
    assert "missing: [3]" in v.detail
    skipped = _history(range(1, 7))
    skipped[3]["cursor"] += 8   # step 4 read the batch after its own: one skipped
    assert [v.invariant for v in check_history(skipped, 6, 8)] == ["data_cursor"]


def test_weights_one_ulp_off_are_caught_where_bit_identity_is_due_and_pass_within_the_bound_elsewhere():
    want = {"w": torch.tensor([1.0, 2.0, 3.0])}
    ulp = {"w": torch.tensor([1.0, float(np.nextafter(np.float32(2.0), np.float32(3.0))), 3.0])}
    assert check_state({"w": want["w"].clone()}, want, off_layout=0, lr=1e-3) == []
    [v] = check_state(ulp, want, off_layout=0, lr=1e-3)
    assert "1 element(s) differ where bit-identity is due" in v.detail
    # Steps run under another layout: within 4 lr a step, not beyond.
    assert check_state(ulp, want, off_layout=1, lr=1e-3) == []
    assert check_state({"w": want["w"] + 0.01}, want, off_layout=2, lr=1e-3)[0].invariant == "final state"
    plans = [{"dp": 2, "pp": 2, "stages": [{"blocks": [0, 4]}, {"blocks": [4, 8]}], "shard_optimizer": "none"},
             {"dp": 1, "pp": 2, "stages": [{"blocks": [0, 4]}, {"blocks": [4, 8]}], "shard_optimizer": "none"}]
    from elastic_trainer.chaos.campaign.checker import layout_of
    hist = _history(range(1, 7))
    for r in hist[2:4]:
        r["plan"] = 1
    assert steps_off_layout(hist, plans, layout_of(plans[0])) == 2


def _part(step, blocks, lo=None, hi=None):
    names = [f"blocks.{b}.w" for b in blocks]
    part = {"step": step, "blocks": blocks, "extra": {},
            "params": {n: np.arange(6, dtype=np.float32).reshape(2, 3) for n in names},
            "optim": {n: {"exp_avg": np.ones(6 if lo is None else hi - lo, np.float32), "step": np.float32(step)}
                      for n in names}}
    if lo is not None:   # a sharded rank's slice: elements [lo, hi) of each parameter and its moments
        part["ranges"] = {n: [lo, hi, [2, 3]] for n in names}
        part["params"] = {n: np.arange(6, dtype=np.float32)[lo:hi] for n in names}
        part["optim"] = {n: {"exp_avg": np.ones(hi - lo, np.float32).reshape(-1), "step": np.float32(step)}
                         for n in names}
    return part


def _manifest(step, parts):
    from elastic_trainer.checkpoint.cover import part_spans
    files = []
    for p in parts:
        f = {"blocks": p["blocks"]}
        if p.get("ranges"):
            f.update(sliced=True, spans=part_spans(p))
        files.append(f)
    return {"step": step, "files": files}


def test_a_checkpoint_with_a_block_or_a_slice_missing_is_caught():
    whole = [_part(4, [0, 1]), _part(4, [2, 3])]
    assert check_checkpoint("ck", _manifest(4, whole), whole, 4) == []
    [v] = check_checkpoint("ck", _manifest(4, whole[:1]), whole[:1], 4)
    assert v.invariant == "checkpoint_cover" and "block(s) [2, 3] in no part" in v.detail
    sliced = [_part(4, [0, 1], 0, 3), _part(4, [0, 1], 3, 6)]
    assert check_checkpoint("ck", _manifest(4, sliced), sliced, 2) == []
    [v] = check_checkpoint("ck", _manifest(4, sliced[:1]), sliced[:1], 2)
    assert "slice is missing" in v.detail
    # The final checkpoint must hold the run's final weights exactly.
    final = {n: torch.from_numpy(a.copy()) for p in whole for n, a in p["params"].items()}
    assert check_checkpoint("ck", _manifest(4, whole), whole, 4, final) == []
    final["blocks.3.w"][0, 0] += 1
    assert check_checkpoint("ck", _manifest(4, whole), whole, 4, final)[0].invariant == "final_checkpoint"


def test_a_checkpoint_is_read_by_the_ranks_of_other_layouts_and_a_read_that_fails_or_differs_is_caught():
    sliced = [_part(4, [0, 1, 2], 0, 4), _part(4, [0, 1, 2], 4, 6)]
    names = sorted(sliced[0]["params"])
    for p, i in zip(sliced, (1.0, 2.0)):
        for n in names:
            p["optim"][n]["exp_avg"] = p["optim"][n]["exp_avg"] * i   # the two writers' slices differ
    _, params, optim = merge_shards(sliced, names)
    # Read whole by one rank, and by 3 stages x 3 ranks whose thirds cut across the writers' slices.
    assert check_resumes("ck", sliced, 3, params, optim) == []
    # A rank of another layout reads a range no part holds: its read fails.
    [v] = check_resumes("ck", sliced[:1], 3, params, optim)
    assert v.invariant == "checkpoint_resumes" and "read at pp=1 x dp=1 (sharded) as rank 0" in v.detail
    # A rank's read that gives other moments than the whole read.
    off = {n: {k: np.array(v, copy=True) for k, v in st.items()} for n, st in optim.items()}
    off["blocks.2.w"]["exp_avg"][1, 0] += 1
    [v] = check_resumes("ck", sliced, 3, params, off)
    assert "blocks.2.w's exp_avg over [0, 6)" in v.detail


def test_a_restore_from_an_abandoned_timeline_and_failures_without_a_fault_are_caught():
    ok = {"kind": "recovery", "restored_step": 8, "timeline": [[1, 0], [2, 8]], "local_generations": {"0": [1]}}
    assert check_timeline([ok]) == []
    stale = {"kind": "recovery", "restored_step": 10, "timeline": [[1, 0], [2, 8], [3, 10]],
             "local_generations": {"1": [1]}}   # step 10 made under set-up 1, rolled back to 8 by set-up 2
    [v] = check_timeline([stale])
    assert v.invariant == "abandoned_timeline" and "set-up(s) [1]" in v.detail
    failure = {"kind": "failure", "failure": "death", "step": 5}
    kill = {"kind": "kill_node", "fault": "kill_node(rank 1) at in_step#3", "done": "node removed"}
    assert check_counts([{"kind": "join", "done": "joined"}], [failure])[0].invariant == "failures_counted"
    assert check_counts([kill], [failure]) == []
    assert check_counts([kill], [])[0].invariant == "failures_counted"
    # A kill at the final save is no failure: the worker is named gone at the end, its stage saved from another.
    gone = {"kind": "checkpoint_problem", "detail": "worker(s) gone at the end: 3 (did not answer a ping)"}
    assert check_counts([kill], [gone]) == []
    # A freeze thawed before anyone waited on it may pass unseen.
    assert check_counts([{"kind": "freeze", "fault": "freeze(rank 0) at setup#1", "done": "frozen"}], []) == []
    assert check_leftovers(["worker 3's process 123"])[0].invariant == "leftovers"
    assert check_end("FAILED", "RunError: x", lethal=1, max_failures=10)[0].invariant == "ended"
    assert check_end("HUNG", None, lethal=0, max_failures=10)[0].invariant == "ended"
    assert check_end("FAILED", "stopped after 4 failures (failure.max_failures 3)", lethal=4, max_failures=3) == []


def test_schedules_replay_from_their_line_and_the_ci_seeds_cover_every_kind_and_point():
    s = draw(7, steps=24, world=4, durable_every=6)
    assert Schedule.from_json(s.to_json()) == s and draw(7, 24, 4, 6) == s
    with pytest.raises(ValueError, match="not a fault schedule"):
        Schedule.from_json('{"faults": [{"kind": "nap"}]}')
    cover = covering(24, 4, 6)
    assert {f.kind for s in cover for f in s.faults} == {"kill_process", "kill_node", "freeze", "join",
                                                          "storage_outage", "drain", "short_drain"}
    assert {f.point for s in cover for f in s.faults} == set(POINTS)


def test_a_failing_schedule_shrinks_to_the_fault_that_fails():
    faults = [Fault("join", "in_step", 3), Fault("kill_node", "restore", 1, rank=2), Fault("freeze", "setup", 1)]
    tried = []

    def fails(s):
        tried.append(len(s.faults))
        return any(f.kind == "kill_node" for f in s.faults)

    assert shrink(Schedule(faults, 5), fails).faults == [faults[1]]


def test_a_run_holds_at_an_armed_point_until_released():
    import threading

    points = FaultPoints(hold_s=30)
    points.arm("in_step", 2)
    points.reach("in_step", step=1)          # the first pass goes on
    done = threading.Event()
    t = threading.Thread(target=lambda: (points.reach("in_step", step=2), done.set()))
    t.start()
    while points.held() is None:
        pass
    assert points.held()["step"] == 2 and not done.is_set()
    points.release()
    assert done.wait(10)
    with pytest.raises(ValueError, match="unknown fault point"):
        points.arm("lunch")


def test_points_reached_on_two_threads_are_held_one_after_the_other():
    # The loop held at a step boundary while the durable writer's thread reached its armed point:
    # the second hold overwrote the first, and the campaign never saw the durable write.
    import threading

    points = FaultPoints(hold_s=30)
    points.arm("between_steps", 1)
    points.arm("durable_write", 1)
    threads = [threading.Thread(target=points.reach, args=(p,), kwargs={"step": 4})
               for p in ("between_steps", "durable_write")]
    for t in threads:
        t.start()
    seen = []
    while len(seen) < 2:
        held = points.held()
        if held and (not seen or seen[-1] != held["point"]):
            seen.append(held["point"])
            points.release()
    for t in threads:
        t.join(10)
    assert sorted(seen) == ["between_steps", "durable_write"] and not any(t.is_alive() for t in threads)


def test_goodput_that_does_not_add_up_or_lost_a_rollback_is_a_violation():
    events = [{"kind": "state", "time": 100.0}, {"kind": "recovery", "steps_rolled_back": 2},
              {"kind": "state", "time": 110.0}]
    good = {"wall_s": 10.0, "seconds": {"training": 8.0, "restore": 1.0, "redone": 1.0}}
    assert check_goodput(good, events, finished=True) == []
    assert "below 0" in str(check_goodput({"wall_s": 10.0, "seconds": {"training": 11.0, "redone": -1.0}},
                                          events, True)[0])
    assert "add up to 9.000 s" in str(check_goodput({"wall_s": 10.0, "seconds": {"training": 8.0, "redone": 1.0}},
                                                   events, True)[0])
    assert "span 5.000 s" in str(check_goodput(good, [events[0], events[1], {"kind": "state", "time": 105.0}],
                                              True)[0])
    assert "2 committed step(s) rolled back, no time redone" in str(
        check_goodput({"wall_s": 10.0, "seconds": {"training": 10.0, "redone": 0.0}}, events, True)[0])
    assert check_goodput(None, events, finished=False) == [] and check_goodput(None, events, True)


def test_a_drain_with_room_to_move_that_ends_as_a_loss_or_redoes_steps_is_a_violation():
    drain = {"kind": "drain", "fault": "drain(rank 3) at in_step#4 for 9s", "done": "drained", "node": "n3",
             "seconds": 9.0}
    moved = {"kind": "recovery", "reason": "drain", "steps_rolled_back": 0}
    assert check_drains([drain], [moved]) == []
    lost = {"kind": "failure", "failure": "death", "node": "n3", "step": 6}
    [v] = check_drains([drain], [lost])
    assert v.invariant == "drain_moved" and "instead of leaving the node" in v.detail
    [v] = check_drains([drain], [dict(moved, steps_rolled_back=2)])
    assert "rolled back 2 committed step(s)" in v.detail
    # A failure elsewhere, a short notice's loss, and a drain skipped are not the drain's.
    assert check_drains([drain], [dict(lost, node="n1")]) == []
    assert check_drains([dict(drain, kind="short_drain")], [lost]) == []
    assert check_drains([dict(drain, done="skipped")], [lost]) == []
    # A drain with room to move is no lethal fault: a failure with only it struck is a false alarm.
    assert check_counts([drain], [lost])[0].invariant == "failures_counted"
    assert check_counts([dict(drain, kind="short_drain")], [lost]) == []
