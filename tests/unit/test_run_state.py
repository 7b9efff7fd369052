"""The run's state machine: the moves in its table work, every other move raises."""

import itertools

import pytest

from elastic_trainer.controller.run.run_state import TRANSITIONS, InvalidTransition, RunState, RunStateMachine

ALL = list(RunState)


@pytest.mark.parametrize("prev,new", [(a, b) for a, b in itertools.product(ALL, ALL) if b in TRANSITIONS[a]])
def test_a_move_in_the_table_returns_previous_and_next(prev, new):
    m = RunStateMachine(prev)
    assert m.move(new) == (prev, new)
    assert m.state is new


@pytest.mark.parametrize("prev,new", [(a, b) for a, b in itertools.product(ALL, ALL) if b not in TRANSITIONS[a]])
def test_every_move_not_in_the_table_raises_and_leaves_the_state(prev, new):
    m = RunStateMachine(prev)
    with pytest.raises(InvalidTransition, match=f"{prev.value} -> {new.value} is not allowed"):
        m.move(new)
    assert m.state is prev


def test_the_table_covers_every_state_and_only_the_end_states_are_final():
    assert set(TRANSITIONS) == set(ALL)
    assert {s for s in ALL if RunStateMachine(s).ended} == {RunState.FINISHED, RunState.STOPPED, RunState.FAILED}
    # Every state before the end can fail, and a run can always reach FINISHED from PENDING.
    assert all(RunState.FAILED in TRANSITIONS[s] for s in ALL if TRANSITIONS[s])
    path = [RunState.PENDING, RunState.PLACING, RunState.STARTING, RunState.RUNNING, RunState.RECOVERING,
            RunState.RUNNING, RunState.RESIZING, RunState.RUNNING, RunState.FINISHED]
    m = RunStateMachine()
    for s in path[1:]:
        m.move(s)
    assert m.ended
