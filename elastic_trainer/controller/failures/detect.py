"""Detect: classify what went wrong in a step: who died, who hung, who raised.

A rank that failed only because a peer did (its collective broke) is a
bystander: it keeps its process and takes part in the re-plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray

from ...worker.step_calls import InjectedFault
from ..stepping.one_step import StepOutcome
from ..run.asking import ask_all

# Words of the error of an actor Ray's memory monitor killed (its node ran low on memory); not a
# process's own "out of memory" (a GPU's, say), which another node would not cure.
_MEMORY_MARKERS = ("low on memory", "memory usage threshold")
# Words of a process's own allocation failing: torch's on the host or a GPU, Python's, the C library's.
_OOM_MARKERS = ("out of memory", "outofmemoryerror", "can't allocate memory", "cannot allocate memory",
                "memoryerror")


def out_of_memory(text: str) -> bool:
    """Whether an error's text says memory ran out (the process's own, or its node's by Ray's monitor)."""
    low = text.lower()
    return any(m in low for m in _OOM_MARKERS + _MEMORY_MARKERS)
# Words of the errors a rank sees when a peer vanishes under a collective.
_COLLECTIVE_MARKERS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket", "broken pipe",
                       "distbackenderror", "process group", "processgroup")


@dataclass
class Diagnosis:
    dead: list[int]          # actor or node gone
    hung: list[int]          # alive process that answers nothing
    raised: list[int]        # the step raised an error of its own (not a peer's)
    kind: str                # death | silent | hang | exception | collective
    detail: str
    silent: list[int] = field(default_factory=list)   # answered no heartbeat (a frozen node, say)
    memory: list[int] = field(default_factory=list)   # of the dead, those Ray's memory monitor killed

    @property
    def lost(self) -> list[int]:
        """The workers this failure takes out of the run."""
        return self.dead + self.silent + self.hung


def is_collective_error(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}".lower()
    return any(m in text for m in _COLLECTIVE_MARKERS)


def diagnose(outcome: StepOutcome, actors: dict[int, object], ping_timeout_s: float,
             heartbeat_timeout_s: float | None = None) -> Diagnosis:
    dead, raised, hung, memory = [], [], [], []
    details = []
    # No heartbeat answered in the whole timeout: nothing more to ask them (a frozen process
    # answers no ping either), and nothing else has failed yet.
    silent = [w for w in outcome.silent if w in outcome.pending]
    for wid in silent:
        details.append(f"worker {wid}: answered no heartbeat in {heartbeat_timeout_s or 0:g}s while its step ran")
    for wid, e in outcome.errors.items():
        if isinstance(e, ray.exceptions.RayActorError):
            dead.append(wid)
            if any(m in str(e).lower() for m in _MEMORY_MARKERS):
                memory.append(wid)
                details.append(f"worker {wid}: {type(e).__name__}, killed by Ray for its node's memory")
            else:
                details.append(f"worker {wid}: {type(e).__name__}")
        elif isinstance(e, ray.exceptions.RayTaskError):
            cause = e.as_instanceof_cause()
            if isinstance(cause, InjectedFault) or not is_collective_error(cause):
                raised.append(wid)
                details.append(f"worker {wid}: {type(cause).__name__}: {str(cause).splitlines()[-1][:200]}")
        else:
            dead.append(wid)
            details.append(f"worker {wid}: {type(e).__name__}: {e}")
    # Workers that did not answer: alive and blocked behind a peer, or hung themselves.
    unknown = [w for w in outcome.pending if w not in outcome.answered and w not in silent]
    if unknown and outcome.errors:
        # Peers failed because their connections closed, and this one has been silent
        # since (pinged at the first error): its process is gone with its node. A hung
        # process keeps its sockets open, so a hang shows as a timeout with no errors.
        for wid in unknown:
            dead.append(wid)
            details.append(f"worker {wid}: silent since its peers lost their connections")
    elif unknown:
        answers = ask_all({wid: actors[wid].ping.remote() for wid in unknown}, ping_timeout_s)
        for wid, answer in answers.items():
            if isinstance(answer, TimeoutError):
                hung.append(wid)
                details.append(f"worker {wid}: no answer to a ping in {ping_timeout_s:g}s")
            elif isinstance(answer, BaseException):
                dead.append(wid)
                details.append(f"worker {wid}: died" if isinstance(answer, ray.exceptions.RayActorError)
                               else f"worker {wid}: its ping failed: {type(answer).__name__}")
    kind = ("death" if dead else "silent" if silent else "hang" if hung else "exception" if raised
            else "collective")
    if kind == "collective":
        details.append("a collective failed while every worker was alive")
    return Diagnosis(dead, hung, raised, kind, "; ".join(details), silent, memory)
