"""A rank's state in and out: its snapshot (parameters, AdamW, the comm layer's state) and its load.

A mixin of ``StageTrainer`` (``worker.stage``), which owns what these read:
its parameters by global name, its optimizer (whole, or sharded: ``zero``),
its gradient sync and model averager, its fp16 loss scale and its snapshot
taker. What a snapshot holds is laid out in ``checkpoint.state``.
"""

from __future__ import annotations

from ..checkpoint.fingerprint import held_fingerprint, saved_fingerprint
from ..checkpoint.state import load_into, merge_shards, pick_comm
from .snapshot_taker import SnapshotJob


class StageState:
    """Snapshots and loads of one rank's state (see the module docstring)."""

    def _comm_state(self) -> tuple[dict, dict]:
        """The comm layer's state by parameter name (error-feedback residuals, DiLoCo's
        outer state) and what it was saved under (codec, replica, dp, PowerSGD's Q)."""
        comm: dict = {}
        meta = {"codec": self.cfg.comm.compression, "replica": self.replica, "dp": self.topo.dp}
        sync_state = self.sync.export_state()
        for name, res in sync_state["residual"].items():
            comm.setdefault(name, {})["residual"] = res
        if sync_state["buckets"]:
            meta["buckets"] = sync_state["buckets"]
        if self.model_avg is not None:
            for kind, per_name in self.model_avg.export_state().items():
                for name, value in per_name.items():
                    comm.setdefault(name, {})[kind] = value
        return comm, meta

    def begin_snapshot(self, step: int, lend: bool) -> SnapshotJob:
        """Start taking this rank's state after ``step`` without waiting for it (see
        ``snapshot_taker``): parameters, AdamW state, and the comm layer's (error-feedback
        residuals, PowerSGD's Q, DiLoCo's outer state, captured now). ``lend``: lend the live
        tensors instead of copying them (where ``snapshots.can_lend``)."""
        comm, meta = self._comm_state()
        if self.zero is not None:
            return self.snapshots.begin(step, lend, self.zero.named_views(), self.optimizer, self.blocks,
                                        self._extra(), comm, meta, ranges=self.zero.ranges())
        return self.snapshots.begin(step, lend, self.named_parameters(), self.optimizer, self.blocks,
                                    self._extra(), comm, meta)

    def export(self, step: int) -> dict:
        """A copy of this rank's state after ``step``, made now."""
        job = self.begin_snapshot(step, lend=False)
        self.snapshots.wait()
        return job.copied()

    def _extra(self) -> dict:
        """Training state beside parameters and optimizer, the same on every rank: fp16's loss scale,
        and the integrity judge's history (the recent losses and norms, the recent anomalies)."""
        extra = {"integrity": self.check.judge.state()}
        if self.scaler is not None:
            extra.update(self.scaler.state_dict())
        return extra

    def restore_want(self) -> tuple[list[int], dict | None]:
        """What a restore must bring this rank: its blocks, and the ranges of the moments it owns
        (a sharded optimizer's rank; None: all of them)."""
        return list(self.blocks), (self.zero.owned_ranges() if self.zero is not None else None)

    def restore_fingerprints(self, shards: list[dict]) -> dict:
        """What the parts this rank loaded held of its tensors, and what it holds now, as
        fingerprints (``checkpoint.fingerprint``), for the controller to compare across its stage."""
        names = [n for n, _ in self.named_parameters()]
        owned = {o.name: (o.view, o.start) for o in self.zero.owned} if self.zero is not None else None
        return {"saved": saved_fingerprint(shards, names), "sharded": self.zero is not None,
                "held": held_fingerprint(self.named_parameters(), self.optimizer, owned)}

    def load(self, shards: list[dict]) -> int:
        """Load this rank's blocks from shards of one step; returns that step.

        Error-feedback residuals are per replica: they come back where the
        shard was written by this replica index under the same dp and codec,
        and start from zero elsewhere (the gradient they owed is dropped).
        """
        self.snapshots.wait()
        names = [n for n, _ in self.named_parameters()]
        step, params, optim = merge_shards(shards, names, self.zero.owned_ranges() if self.zero is not None else None,
                                           pieces=True)
        load_into(self.named_parameters(), self.optimizer, params, optim if self.zero is None else {})
        if self.zero is not None:
            self.zero.load_state(optim)
        extra = shards[0].get("extra") or {}
        if self.scaler is not None:
            self.scaler.load_state_dict(extra)
        self.check.judge.load(extra.get("integrity"))

        def own(meta: dict) -> bool:
            return (meta.get("replica"), meta.get("dp"), meta.get("codec")) == (
                self.replica, self.topo.dp, self.cfg.comm.compression)

        comm, buckets = pick_comm(shards, names, own)
        self.sync.load_state(
            {"codec": self.cfg.comm.compression, "buckets": buckets,
             "residual": {n: c["residual"] for n, c in comm.items() if "residual" in c}}, set(names))
        if self.model_avg is not None:
            self.model_avg.load_state({kind: {n: c[kind] for n, c in comm.items() if kind in c}
                                       for kind in ("outer", "momentum")})
        return step

