"""Where the final weights of each pipeline stage come from: replica 0's worker, else another live
DP replica of the stage, else the snapshot of the final step on a live node, else an error naming
the stage and what is gone (controller/state/final_sources.py)."""

from elastic_trainer.controller.state.final_sources import lost_stages_error, snapshot_cover, stage_replicas, take_stages
from elastic_trainer.errors import RunError
from elastic_trainer.parallel.topology import Topology

TOPO = Topology(dp=2, pp=2)                  # rank = replica * 2 + stage
RANKS = {0: 10, 1: 11, 2: 12, 3: 13}         # rank -> worker id


def test_each_stage_lists_its_live_replicas_replica_0_first():
    assert stage_replicas(TOPO, RANKS, {10, 11, 12, 13}) == {0: [10, 12], 1: [11, 13]}
    # Replica 0's worker of stage 0 is gone: stage 0 comes from replica 1, stage 1 as before.
    assert stage_replicas(TOPO, RANKS, {11, 12, 13}) == {0: [12], 1: [11, 13]}
    assert stage_replicas(TOPO, RANKS, {10, 12}) == {0: [10, 12], 1: []}
    # One that missed a ping (its node may be gone, or it is only slow) is asked last, not never.
    assert stage_replicas(TOPO, RANKS, {10, 11, 12, 13}, late=frozenset({10, 13})) == {0: [12, 10], 1: [11, 13]}


def test_a_worker_that_fails_its_answer_hands_the_stage_to_the_next_replica():
    asked = []

    def ask(round_):
        asked.append(dict(round_))
        return {s: (ConnectionError("actor died") if w == 10 else {f"blocks.{s}.w": w}) for s, w in round_.items()}

    got, failed = take_stages({0: [10, 12], 1: [11, 13]}, ask)
    assert got == {0: (12, {"blocks.0.w": 12}), 1: (11, {"blocks.1.w": 11})}
    assert failed == {10: "ConnectionError: actor died"}
    # Every open stage is asked at once; only the stage whose worker failed is asked again.
    assert asked == [{0: 10, 1: 11}, {0: 12}]


def test_a_stage_none_of_whose_workers_answers_is_left_open():
    got, failed = take_stages({0: [10], 1: [11, 13]},
                              lambda r: {s: TimeoutError("no answer in 20s") if s == 1 else "w0" for s in r})
    assert got == {0: (10, "w0")} and failed == {11: "TimeoutError: no answer in 20s",
                                                  13: "TimeoutError: no answer in 20s"}
    assert take_stages({0: []}, lambda r: {}) == ({}, {})


def test_the_final_steps_snapshot_stands_in_only_with_its_parts_on_live_nodes():
    parts = {1: ([3, 4], "node-b"), 3: ([5], "node-d"), 0: ([0, 1, 2], "node-a")}
    assert snapshot_cover(parts, {3, 4, 5}, {"node-a", "node-b", "node-d"}) == [1, 3]
    assert snapshot_cover(parts, {3, 4, 5}, {"node-a", "node-b"}) is None   # block 5's part went with node-d
    assert snapshot_cover({}, {3}, {"node-a"}) is None


def test_no_live_replica_and_no_snapshot_of_the_step_is_an_error_naming_the_stage_and_what_is_gone():
    err = lost_stages_error("r", 30, {1: [(0, 11, "ActorDiedError: the actor died"), (1, 13, "did not answer a ping")]},
                            {1: [3, 4, 5]}, newest_snapshot=28)
    assert isinstance(err, RunError)
    assert str(err) == (
        "run r: the final weights of step 30 cannot be gathered: stage 1 (blocks 3..5) has no live replica "
        "(replica 0, worker 11: ActorDiedError: the actor died; replica 1, worker 13: did not answer a ping) "
        "and no snapshot of step 30 holds it on a live node; the newest snapshot kept is of step 28: the "
        "emergency copy saves the newest one that survives")
    two = lost_stages_error("r", 5, {0: [(0, 10, "gone")], 1: [(0, 11, "gone")]}, {0: [0, 1, 2], 1: [3, 4, 8, 9]},
                            newest_snapshot=None)
    assert "stage 0 (blocks 0..2) has no live replica (replica 0, worker 10: gone); stage 1" in str(two)
    assert "stage 1 (blocks 3..4, 8..9)" in str(two)   # a rank of interleaved stages holds two spans
    assert str(two).endswith("no snapshot of step 5 holds them on a live node; no snapshot is kept to save instead")


def test_the_final_checkpoint_from_exports_takes_every_replica_of_a_sharded_stage():
    from elastic_trainer.controller.state.final_sources import exported_parts

    order = stage_replicas(TOPO, RANKS, {10, 11, 12, 13})
    assert exported_parts(order, sharded=False, dp=2) == [10, 11]           # one replica a stage is whole
    assert exported_parts(order, sharded=True, dp=2) == [10, 12, 11, 13]    # each replica holds its slice
    # A sharded stage that lost a replica lost that slice of its moments: no export makes it whole.
    # (Before, the first live replica's part was written, and the run ended FINISHED with a
    # checkpoint that a resume refused.)
    lost = stage_replicas(TOPO, RANKS, {10, 11, 13})
    assert exported_parts(lost, sharded=False, dp=2) == [10, 11]
    assert exported_parts(lost, sharded=True, dp=2) is None
    assert exported_parts(stage_replicas(TOPO, RANKS, {10, 12}), sharded=False, dp=2) is None
