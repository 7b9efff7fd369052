"""A rank's side of the silent-data-corruption checks (``integrity.state_fingerprint``).

On a check step, after its update, a rank fingerprints what it holds: its parameters, which
every replica of its stage holds bit for bit (``comm.sync: allreduce``; local steps and a
parameter server: right after a meeting or a pull), and the optimizer state it keeps. The
controller compares each stage's replicas. The rank also keeps that fingerprint and, before its
next update, reads its state again: state that changed while nothing wrote it (memory, at rest;
a sharded optimizer's slice has no replica to be compared with) is flagged in that step's
verdict (``step_check``), so no rank applies the step, and the rank's own checksum proves it.

Also the ``flip`` fault (``worker.integrity_faults``): one bit of one element of a gradient, a
parameter or the optimizer state, as hardware corrupts it.
"""

from __future__ import annotations

import time

import torch

from ..integrity.state_fingerprint import differing, state_fingerprint


class StateChecks:
    """What ``StageTrainer`` fingerprints and flips; ``trainer``: that stage trainer."""

    def __init__(self, trainer):
        self.t = trainer
        self._rest: dict[str, int] | None = None   # what this rank held after its last check
        self.rest_s = 0.0                            # what reading it again cost (the next check's)

    def _owned(self) -> dict | None:
        z = self.t.zero
        return {o.name: o.view for o in z.owned} if z is not None else None

    def _held(self) -> tuple[dict, dict]:
        """(parameters, optimizer state) fingerprints of what this rank holds: its parameters whole
        (a sharded rank's gathered), the optimizer state it keeps (a sharded rank's slice's)."""
        t = self.t
        if t.zero is None:   # one pass: each parameter, then its state
            both = state_fingerprint(t.named_parameters(), t.optimizer)
            params = {k: v for k, v in both.items() if k.endswith("|param")}
            return params, {k: v for k, v in both.items() if not k.endswith("|param")}
        params = state_fingerprint(t.named_parameters(), t.optimizer, optim=False)
        named = [(o.name, o.view) for o in t.zero.owned]
        return params, state_fingerprint(named, t.optimizer, self._owned(), params=False)

    def fingerprint(self) -> tuple[dict, float]:
        """``{"params": ..., "optim": ...}`` of what this rank holds after a check step's update,
        kept for the at-rest check at its next update; and the seconds it took (with the last
        at-rest read's)."""
        t0 = time.perf_counter()
        params, optim = self._held()
        self._rest = {**{f"param:{k}": v for k, v in params.items()}, **{f"optim:{k}": v for k, v in optim.items()}}
        spent, self.rest_s = time.perf_counter() - t0 + self.rest_s, 0.0
        return {"params": params, "optim": optim, "sharded": self.t.zero is not None}, spent

    def changed_at_rest(self) -> list[str]:
        """Before the update after a check: what this rank holds that changed since the check,
        while nothing wrote it (read once; empty where nothing is kept or nothing changed)."""
        if self._rest is None:
            return []
        t0 = time.perf_counter()
        params, optim = self._held()
        now = {**{f"param:{k}": v for k, v in params.items()}, **{f"optim:{k}": v for k, v in optim.items()}}
        was, self._rest = self._rest, None
        self.rest_s = time.perf_counter() - t0
        return differing(was, now)

    def flip(self, step: int, where: str) -> None:
        """The injected ``flip`` into ``where`` at ``step`` on this rank, if one is due."""
        faults = self.t.faults
        spec = faults.flip(step, self.t.rank, where) if faults is not None else None
        if spec is None:
            return
        t = self.t
        named = dict(t.named_parameters())
        name = spec.get("name") or (t.zero.owned[0].name if t.zero is not None and where == "optimizer"
                                    else next(iter(named)))
        p = named[name]
        if where == "parameter":
            target = p.detach()
        elif where == "gradient":
            target = p.grad
        else:
            key = p if t.zero is None else self._owned().get(name)
            state = t.optimizer.state.get(key) or {}
            target = state.get(spec.get("state", "exp_avg"))
        if target is None:
            raise ValueError(f"flip into the {where} of {name!r} at step {step}: rank {t.rank} holds none")
        flat = target.view(-1)
        bits = flat.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[flat.element_size()])
        with torch.no_grad():
            bits[int(spec.get("index", 0))] ^= 1 << int(spec.get("bit", 20))
