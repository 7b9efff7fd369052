"""What a run leaves behind: at the end, the final durable checkpoint and the weights, both
verified; on the way out of a failed run, an emergency copy of the newest surviving snapshot.

A run ends FINISHED (or STOPPED) only once everything it was asked to keep is
written and read back. A save that fails ends it FAILED with :class:`SaveError`,
which names what was not saved and where each unsaved part is kept (on its
writer's node): no process gathers the model to carry it on the error.

Each part is written where it is: the final weights by a live replica of each
stage (``final_weights``), the durable checkpoint's parts by the workers that
made them (``durable_writer``). A stage with no live replica comes from the
snapshot of the last step where its parts sit on a live node; a stage with
neither fails the run with an error naming the stage and what is gone, and
the emergency copy then saves the newest snapshot that survives
(``final_sources`` chooses).
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import ray
import torch

from ...checkpoint.durable import DurableStore
from ...checkpoint.hf_export import hf_names, recorded_config
from ...checkpoint.weights import WeightsError, weights_from_shards
from ...secrets import mask_values
from ...storage.uris import split_last
from ...config import TrainerConfig
from ...errors import RunError
from .durable_writer import DurableWriter
from .final_sources import exported_parts, lost_stages_error, snapshot_cover, stage_replicas, take_stages
from .final_weights import FinalWeights, PartsNotSaved
from ..run.ps_group import ParameterServers
from ..run.run_record import RunRecord
from .snapshots import SnapshotStore
from ..run.workers import WorkerPool
from ..run.asking import ask_all

log = logging.getLogger(__name__)


class SaveError(RunError):
    """The run trained to the end but what it had to keep was not (all) saved."""


class RunSaver:
    def __init__(self, cfg: TrainerConfig, run: RunRecord, pool: WorkerPool, snapshots: SnapshotStore,
                 durable: DurableStore | None, writer: Callable[[], DurableWriter | None],
                 ps: Callable[[], ParameterServers | None]):
        self.cfg, self.run, self.pool, self.snapshots, self.durable = cfg, run, pool, snapshots, durable
        self._writer, self._ps = writer, ps
        self.emergency_done = False
        # kind hf: the resolved transformers config, recorded with the weights for the export.
        self.hf_config = recorded_config(cfg.model)
        self.weights = FinalWeights(cfg, run, pool, snapshots, self._meta, self._hf)

    def _meta(self, step: int) -> dict:
        run = self.run
        meta = {"run": run.name, "run_id": run.run_id, "step": step, "format": "elastic_trainer",
                # Weights travel: a secret-named factory argument (a hub token) stays behind.
                "model": mask_values(self.cfg.model.model_dump(mode="json"), self.cfg.run.secret_names)}
        if self.hf_config is not None:
            meta["hf_config"] = self.hf_config
        return meta

    def gather_state(self) -> dict:
        """Full model state of the last step, in this process, for a caller that asked for it
        (``Trainer.fit(return_model_state=True)``; the saves never gather): each stage from its
        first live replica (every replica holds the same weights), else from the snapshot of the
        step. Raises :class:`RunError` naming each stage none of which is left."""
        run = self.run
        topo, wids = run.plan.topology, sorted(set(run.ranks.values()))
        gone = {w: "no longer in the pool" for w in wids if w not in self.pool}
        # A ping first, so a worker lost with its node does not hold a stage for comm.timeout_s
        # while another replica could answer; one that missed it is still asked, last.
        late = frozenset(self.pool.dead_among([w for w in wids if w not in gone]))
        order = stage_replicas(topo, run.ranks, set(wids) - set(gone), late)
        got, failed = take_stages(order, lambda asks: ask_all(
            {s: self.pool[w].actor.state_dict.remote() for s, w in asks.items()}, self.cfg.comm.timeout_s))
        used = {w for w, _ in got.values()}
        gone.update({w: "did not answer a ping" for w in late - used})
        gone.update(failed)
        if gone:
            self.pool.drop([w for w in gone if w in self.pool])
        out = {}
        for _, part in got.values():
            out.update(part)
        from_snapshot, left = [], []
        for s in sorted(set(range(topo.pp)) - set(got)):
            part = self._stage_from_snapshot(s)
            if part is None:
                left.append(s)
            else:
                out.update(part)
                from_snapshot.append(s)
        if gone:
            moved = [f"stage {s} from worker {w}" for s, (w, _) in sorted(got.items())
                     if w != run.ranks[topo.rank(0, s)]]
            detail = ("worker(s) gone at the end: " + "; ".join(f"{w} ({why})" for w, why in sorted(gone.items()))
                      + (f"; final weights of {', '.join(moved)}" if moved else "")
                      + (f"; stage(s) {', '.join(map(str, from_snapshot))} from the snapshot of step {run.step}"
                         if from_snapshot else ""))
            run.event("checkpoint_problem", step=run.step, detail=detail)
            log.warning("[%s] %s", run.name, detail)
        if left:
            lost = {s: [(d, run.ranks[topo.rank(d, s)], gone.get(run.ranks[topo.rank(d, s)], "gave no answer"))
                        for d in range(topo.dp)] for s in left}
            committed = self.snapshots.committed_steps()
            raise lost_stages_error(run.name, run.step, lost,
                                    {s: run.plan.blocks_of(topo.rank(0, s)) for s in left},
                                    committed[-1] if committed else None)
        return out

    def _stage_from_snapshot(self, stage: int) -> dict | None:
        """Stage ``stage``'s weights from the snapshot of the last step, where its parts sit on
        live nodes (None otherwise, or if reading them fails): the same step as the live
        replicas', so the model stays one step's."""
        run = self.run
        snap = self.snapshots.snaps.get(run.step)
        if snap is None:
            return None
        parts = {r: (e.blocks, e.node, e.group) for r, e in snap.shards.items()}
        picked = snapshot_cover(parts, set(run.plan.blocks_of(run.plan.topology.rank(0, stage))), self.pool.nodes())
        if picked is None:
            return None
        try:
            shards = ray.get([snap.shards[r].ref for r in picked], timeout=self.cfg.comm.timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as e:
            log.warning("[%s] the snapshot of step %d could not stand in for stage %d: %s", run.name,
                        run.step, stage, e)
            return None
        # A bf16 parameter is stored as its bits (int16); no parameter is an int16 of its own.
        bits = {n: torch.bfloat16 for sh in shards for n, a in sh["params"].items() if a.dtype == np.int16}
        return weights_from_shards(shards, bits)

    def final(self) -> dict:
        """Write the final durable checkpoint (with storage) and the weights of the last step to
        ``run.output_dir``, each part where it is (``final_weights``);
        ``{"durable_path", "model_path", "hf_path"}``.

        Raises :class:`SaveError` naming what was not saved, and where each unsaved part is kept."""
        run = self.run
        missing, out = [], {"durable_path": None, "model_path": None, "hf_path": None}
        # A ping first: a worker lost with its node holds no part of the durable checkpoint, and
        # is asked for its stage's weights after the other replicas, not before.
        wids = sorted(w for w in set(run.ranks.values()) if w in self.pool)
        late = frozenset(self.pool.dead_among(wids))
        if self._writer():
            try:
                out["durable_path"] = self._final_durable(late)
            except Exception as e:  # noqa: BLE001 - named in the SaveError below
                missing.append(f"the final durable checkpoint of step {run.step} in "
                               f"{self.cfg.checkpoint.storage} ({type(e).__name__}: {e})")
        kept: list[dict] = []
        try:
            written = self.weights.write(self.cfg.run.output_dir, late)
            out["model_path"], out["hf_path"] = written["model_path"], written["hf_path"]
        except PartsNotSaved as e:
            kept = e.parts
            missing.append(f"the weights ({e})")
        except WeightsError as e:
            missing.append(f"the weights ({e})")
        if missing:
            err = SaveError(f"run {run.name} trained {run.step} steps but did not save " + "; ".join(missing)
                            + (". Each unsaved part is kept on its node where named (error.parts)." if kept else ""))
            err.parts = kept
            raise err
        return out

    def _hf(self) -> tuple[dict, object] | None:
        """(global -> Hugging Face name, the transformers config) of a ``kind: hf`` model."""
        if self.cfg.model.kind != "hf":
            return None
        return hf_names(self.cfg.model, self.hf_config)

    def _final_durable(self, late: frozenset) -> str:
        run = self.run
        self._writer().wait()
        topo = run.plan.topology
        live = {r: w for r, w in run.ranks.items() if w in self.pool and w not in late}
        whole = len(live) == len(run.ranks)
        # With a worker gone (gather_state dropped it), only parts with a copy that lives are read.
        parts = (self._writer().shards(run.step) if whole
                 else self._writer().shards(run.step, self.pool.nodes(), set(live.values())))
        if not parts:
            # The last step has no snapshot kept (none due, or dropped): export one from every
            # live rank, and write each stage's first live replica's part (every replica's,
            # sharded: each holds its slice of the moments), whatever becomes of their copies.
            exported = {w: self.pool[w].actor.export_snapshot.remote(run.step) for w in live.values()}
            if whole:
                self.snapshots.take_step(run.step, {r: self.pool[w] for r, w in live.items()}, exported, full=True)
            if self._ps():
                self._ps().snapshot(run.step)
            order = stage_replicas(topo, run.ranks, set(live.values()))
            sharded = run.plan.shard_optimizer != "none" and topo.dp > 1
            writers = exported_parts(order, sharded, topo.dp) or []
            parts = ((self._writer().shards(run.step) if whole or self._ps() else [])
                     or [(exported[w], self.pool[w].node, self.pool[w].actor) for w in writers])
        if not parts:
            gone = sorted(set(run.ranks) - set(live))
            raise RuntimeError(f"no snapshot of step {run.step} covers every block, and the live ranks cannot "
                               f"export it whole (rank(s) {gone} gone"
                               + (", each holding a slice of its stage's sharded optimizer state)"
                                  if run.plan.shard_optimizer != "none" else ")"))
        path = self._writer().write(run.step, parts, list(run.history), run.plan.describe(), raise_errors=True)
        # Each part was read back against its checksum by its writer; the manifest is read here.
        manifest = self.durable.read_manifest(split_last(path)[1])
        if manifest.get("step") != run.step or not manifest.get("files"):
            raise RuntimeError(f"the manifest at {path} does not describe step {run.step}'s parts")
        return path

    def emergency(self, why: str) -> str | None:
        """On the way out of a failed run: save the newest committed snapshot that survives, as a
        durable checkpoint (with storage) or as weights in ``run.output_dir``. Never raises: the
        run's own error is what the user must see."""
        run = self.run
        if self.emergency_done:
            return None
        self.emergency_done = True
        try:
            if self._writer():
                path = self._writer().emergency(self.pool.nodes(), set(self.pool.workers), run.history,
                                            run.plan.describe() if run.plan else {})
            else:
                path = self._emergency_weights()
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.error("[%s] emergency checkpoint failed: %s: %s", run.name, type(e).__name__, e)
            run.event("checkpoint_problem", detail=f"emergency checkpoint failed: {type(e).__name__}: {e}")
            return None
        if path:
            run.event("emergency_checkpoint", path=path, reason=why[:300])
            log.warning("[%s] emergency checkpoint at %s (%s)", run.name, path, why[:200])
        return path

    def _emergency_weights(self) -> str | None:
        for step in reversed(self.snapshots.committed_steps()):
            path = self.weights.write_snapshot(step, self.cfg.run.output_dir, len(self.run.counts))
            if path:
                return path
        return None
