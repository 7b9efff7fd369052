from elastic_trainer.controller.state.restore import Load, Source, choose_restore, plan_loads


def test_live_copies_win_and_the_latest_covering_step_is_chosen():
    live = {0: {9: [0, 1], 10: [0, 1]}, 1: {9: [2, 3], 10: [2, 3]}}
    snaps = {9: {"a": [0, 1, 2, 3]}}
    step, chosen = choose_restore(4, live, snaps, {})
    assert step == 10 and {s.tier for s in chosen.values()} == {"live"}


def test_a_lost_stage_comes_from_the_snapshot_of_a_step_every_block_has():
    # Blocks 2-3 lived only on a lost worker; its step-10 shard never got replicated.
    live = {0: {9: [0, 1], 10: [0, 1]}}
    snaps = {9: {"r0": [0, 1], "r1": [2, 3]}, 10: {"r0": [0, 1]}}
    step, chosen = choose_restore(4, live, snaps, {})
    assert step == 9
    assert chosen[0].tier == "live" and chosen[2].tier == "snapshot" and chosen[2].part == "r1"
    assert {s.step for s in chosen.values()} == {9}


def test_a_step_that_did_not_commit_is_never_restored():
    live = {0: {9: [0, 1], 10: [0, 1]}, 1: {9: [0, 1], 10: [0, 1]}}
    assert choose_restore(2, live, {}, {}, max_step=9)[0] == 9


def test_durable_is_the_last_resort_and_none_when_nothing_covers():
    assert choose_restore(2, {}, {}, {4: {0: [0, 1]}})[0] == 4
    assert choose_restore(2, {0: {5: [0]}}, {}, {}) is None


def test_each_rank_loads_its_own_copy_first_then_the_chosen_sources():
    live = Source("live", 5, frozenset({0, 1}), worker=10)
    writer = Source("live", 5, frozenset({2}), worker=11)
    snap = Source("snapshot", 5, frozenset({3}), part=3)
    durable = Source("durable", 5, frozenset({4}), shard=0)
    chosen = {0: live, 1: live, 2: writer, 3: snap, 4: durable}
    ranks = {0: 10, 1: 12}
    loads = plan_loads(chosen, ranks, {0: [0, 1], 1: [1, 2, 3, 4]}, own={10: [0, 1]}, written={11: [2]})
    assert loads[0] == [Load("local")]
    # Block 1 from worker 10's local copy, block 2 from the part worker 11 wrote (its only copy).
    assert loads[1] == [Load("export", worker=10, blocks=(1,)), Load("written", worker=11),
                        Load("snapshot", part=3), Load("durable", shard=0)]
