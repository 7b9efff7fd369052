"""Classify what went wrong in a step: who died, who hung, who raised, who was a bystander."""

from __future__ import annotations

from dataclasses import dataclass, field

import ray

from ..worker.actor import InjectedFault

# Words of the errors a rank sees when a peer vanishes under a collective.
_COLLECTIVE_MARKERS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket", "broken pipe",
                       "distbackenderror", "process group", "processgroup")


@dataclass
class StepOutcome:
    step: int
    started: float
    results: dict[int, dict] = field(default_factory=dict)    # worker id -> step result
    errors: dict[int, BaseException] = field(default_factory=dict)
    pending: list[int] = field(default_factory=list)          # no answer by the deadline
    answered: set = field(default_factory=set)                # pending ranks that answered a ping
    first_signal: float | None = None                         # first error, or the deadline

    @property
    def ok(self) -> bool:
        return not self.errors and not self.pending


@dataclass
class Diagnosis:
    dead: list[int]          # actor or node gone
    hung: list[int]          # alive process that answers nothing
    raised: list[int]        # the step raised an error of its own (not a peer's)
    bystanders: list[int]    # failed only because a peer did
    kind: str                # death | hang | exception | collective
    detail: str


def is_collective_error(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}".lower()
    return any(m in text for m in _COLLECTIVE_MARKERS)


def diagnose(outcome: StepOutcome, actors: dict[int, object], ping_timeout_s: float) -> Diagnosis:
    dead, raised, bystanders, hung = [], [], [], []
    details = []
    for wid, e in outcome.errors.items():
        if isinstance(e, ray.exceptions.RayActorError):
            dead.append(wid)
            details.append(f"worker {wid}: {type(e).__name__}")
        elif isinstance(e, ray.exceptions.RayTaskError):
            cause = e.as_instanceof_cause()
            if isinstance(cause, InjectedFault) or not is_collective_error(cause):
                raised.append(wid)
                details.append(f"worker {wid}: {type(cause).__name__}: {str(cause).splitlines()[-1][:200]}")
            else:
                bystanders.append(wid)
        else:
            dead.append(wid)
            details.append(f"worker {wid}: {type(e).__name__}: {e}")
    # Workers that did not answer: alive and blocked behind a peer, or hung themselves.
    bystanders += [w for w in outcome.pending if w in outcome.answered]
    unknown = [w for w in outcome.pending if w not in outcome.answered]
    if unknown and outcome.errors:
        # Peers failed because their connections closed, and this one has been silent
        # since (pinged at the first error): its process is gone with its node. A hung
        # process keeps its sockets open, so a hang shows as a timeout with no errors.
        for wid in unknown:
            dead.append(wid)
            details.append(f"worker {wid}: silent since its peers lost their connections")
    elif unknown:
        pings = {wid: actors[wid].ping.remote() for wid in unknown}
        ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=ping_timeout_s)
        for wid, ref in pings.items():
            if ref not in ready:
                hung.append(wid)
                details.append(f"worker {wid}: no answer to a ping in {ping_timeout_s:g}s")
                continue
            try:
                ray.get(ref)
                bystanders.append(wid)
            except ray.exceptions.RayActorError:
                dead.append(wid)
                details.append(f"worker {wid}: died")
    kind = "death" if dead else "hang" if hung else "exception" if raised else "collective"
    if kind == "collective":
        details.append("a collective failed while every worker was alive")
    return Diagnosis(dead, hung, raised, bystanders, kind, "; ".join(details))
