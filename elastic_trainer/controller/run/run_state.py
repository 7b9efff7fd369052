"""The run's states and the transitions allowed between them.

The controller moves only along ``TRANSITIONS``: a move outside it is a bug
in the controller, caught at the move rather than seen later as a run that
reports RUNNING after it failed. Like Ray Train v2's controller, a move
returns ``(previous, next)`` so the caller can log and test it.
"""

from __future__ import annotations

import enum

from ...errors import ElasticTrainerError


class RunState(str, enum.Enum):
    PENDING = "PENDING"          # created, nothing started
    PLACING = "PLACING"          # finding nodes, starting workers
    STARTING = "STARTING"        # first set-up: groups, blocks, restore on resume
    RUNNING = "RUNNING"          # steps
    RECOVERING = "RECOVERING"    # a step failed: detect, re-plan, restore
    RESIZING = "RESIZING"        # nodes joined: re-plan onto more workers
    FINISHED = "FINISHED"        # every step run, everything saved
    STOPPED = "STOPPED"          # Controller.stop() before the last step; what it had is saved
    FAILED = "FAILED"


S = RunState
TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    S.PENDING: frozenset({S.PLACING, S.FAILED}),
    S.PLACING: frozenset({S.STARTING, S.FAILED}),
    # A worker or node lost before the first step is recovered from like any other loss.
    S.STARTING: frozenset({S.RUNNING, S.RECOVERING, S.FAILED}),
    # The step loop leaves on a stop only between steps, in RUNNING: a stop asked during a
    # recovery or a resize takes effect once it is back there.
    S.RUNNING: frozenset({S.RECOVERING, S.RESIZING, S.FINISHED, S.STOPPED, S.FAILED}),
    # A failure during a resize is retried inside it, as during a recovery.
    S.RESIZING: frozenset({S.RUNNING, S.FAILED}),
    S.RECOVERING: frozenset({S.RUNNING, S.FAILED}),
    S.FINISHED: frozenset(),
    S.STOPPED: frozenset(),
    S.FAILED: frozenset(),
}
del S


class InvalidTransition(ElasticTrainerError):
    """The controller tried a move its state machine does not allow."""


class RunStateMachine:
    """The current state, moved only along ``TRANSITIONS``."""

    def __init__(self, state: RunState = RunState.PENDING):
        self.state = state

    def move(self, new: RunState) -> tuple[RunState, RunState]:
        """Go to ``new``; returns ``(previous, new)``. Raises :class:`InvalidTransition` off the table."""
        allowed = TRANSITIONS[self.state]
        if new not in allowed:
            raise InvalidTransition(
                f"run state {self.state.value} -> {new.value} is not allowed; from {self.state.value} the run "
                f"may go to {', '.join(sorted(s.value for s in allowed)) or 'nowhere (it has ended)'}")
        prev, self.state = self.state, new
        return prev, new

    @property
    def ended(self) -> bool:
        return not TRANSITIONS[self.state]
