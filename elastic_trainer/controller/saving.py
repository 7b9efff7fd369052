"""What a run leaves behind: at the end, the final durable checkpoint and the weights, both
verified; on the way out of a failed run, an emergency copy of the newest surviving snapshot.

A run ends FINISHED (or STOPPED) only once everything it was asked to keep is
written and read back. A save that fails ends it FAILED with :class:`SaveError`,
which names what was not saved; the controller then keeps the weights it
gathered (``unsaved``) until the driver has taken them.

The final weights of a pipeline stage come from replica 0's worker, else from
another live DP replica of the stage (a worker lost after the last step
costs nothing: every replica holds the same weights), else from the snapshot
of the last step where its parts sit on a live node. A stage with none of
these fails the run with an error naming the stage and what is gone, and the
emergency copy then saves the newest snapshot that survives. The choice is
made by the pure functions below (``stage_replicas``, ``take_stages``,
``snapshot_cover``, ``lost_stages_error``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
import ray
import torch

from ..checkpoint.durable import DurableStore
from ..checkpoint.hf_export import recorded_config, write_hf_folder
from ..checkpoint.weights import WeightsError, save_weights, weights_from_shards
from ..config import TrainerConfig
from ..errors import RunError, error_line
from .durable_writer import DurableWriter
from .ps_group import ParameterServers
from .run_record import RunRecord
from .snapshots import SnapshotStore
from .workers import WorkerPool, ask_all

log = logging.getLogger(__name__)


class SaveError(RunError):
    """The run trained to the end but what it had to keep was not (all) saved."""


def stage_replicas(topo, ranks: dict[int, int], alive: set[int], late: frozenset[int] = frozenset()) \
        -> dict[int, list[int]]:
    """Each pipeline stage's live workers (``ranks``: rank -> worker id; ``alive``: worker ids),
    replica 0's first: where the stage's final weights can come from, in the order to ask. Those
    in ``late`` (they missed a ping: gone, or only slow) come after the others, not never."""
    out = {}
    for s in range(topo.pp):
        held = [ranks[topo.rank(d, s)] for d in range(topo.dp) if ranks[topo.rank(d, s)] in alive]
        out[s] = [w for w in held if w not in late] + [w for w in held if w in late]
    return out


def take_stages(order: dict[int, list[int]], ask: Callable[[dict[int, int]], dict]) -> tuple[dict, dict]:
    """Each stage's answer from the first of its workers (``order``: stage -> worker ids) that
    gives one. ``ask`` ({stage: worker} -> {stage: its answer, or the exception it raised})
    asks one worker of every stage still open at once; a stage whose worker failed asks its
    next. Returns ({stage: (worker, answer)} of the stages answered, {worker: why} of those
    that failed); a stage none of whose workers answered is in neither."""
    queues = {s: list(ws) for s, ws in order.items()}
    got: dict[int, tuple] = {}
    failed: dict[int, str] = {}
    while True:
        asks = {s: q.pop(0) for s, q in queues.items() if s not in got and q}
        if not asks:
            return got, failed
        for s, answer in ask(asks).items():
            if isinstance(answer, BaseException):
                failed[asks[s]] = error_line(answer)
            else:
                got[s] = (asks[s], answer)


def snapshot_cover(parts: dict[int, tuple[list[int], str]], need: set[int], alive_nodes: set[str]) -> list[int] | None:
    """Ranks of a snapshot's parts (rank -> (blocks, node its object is on)) that sit on live
    nodes and together hold every block of ``need``; None if they do not."""
    picked, seen = [], set()
    for r, (blocks, node) in sorted(parts.items()):
        mine = set(blocks) & need
        if node in alive_nodes and mine and not mine <= seen:
            picked.append(r)
            seen |= mine
    return picked if seen >= need else None


def lost_stages_error(run: str, step: int, lost: dict[int, list[tuple[int, int, str]]],
                      blocks: dict[int, list[int]], newest_snapshot: int | None) -> RunError:
    """The error of final weights that cannot be gathered. ``lost``: stage -> (replica, worker,
    why) of each of its workers; ``blocks``: stage -> its blocks; ``newest_snapshot``: the newest
    step with a snapshot kept, which the emergency copy falls back to."""
    stages = "; ".join(
        f"stage {s} (blocks {_spans(blocks[s])}) has no live replica ("
        + "; ".join(f"replica {d}, worker {w}: {why}" for d, w, why in gone) + ")"
        for s, gone in sorted(lost.items()))
    return RunError(
        f"run {run}: the final weights of step {step} cannot be gathered: {stages} and no snapshot of step "
        f"{step} holds {'it' if len(lost) == 1 else 'them'} on a live node; "
        + (f"the newest snapshot kept is of step {newest_snapshot}: the emergency copy saves the newest one that "
           "survives" if newest_snapshot is not None else "no snapshot is kept to save instead"))


def _spans(blocks: list[int]) -> str:
    """Blocks as runs of consecutive ids: [3, 4, 8, 9] -> '3..4, 8..9'."""
    spans: list[list[int]] = []
    for b in sorted(blocks):
        if spans and b == spans[-1][1] + 1:
            spans[-1][1] = b
        else:
            spans.append([b, b])
    return ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in spans)


class RunSaver:
    def __init__(self, cfg: TrainerConfig, run: RunRecord, pool: WorkerPool, snapshots: SnapshotStore,
                 durable: DurableStore | None, writer: Callable[[], DurableWriter | None],
                 ps: Callable[[], ParameterServers | None]):
        self.cfg, self.run, self.pool, self.snapshots, self.durable = cfg, run, pool, snapshots, durable
        self._writer, self._ps = writer, ps
        self.unsaved: dict | None = None   # weights gathered for a save that failed, for the driver
        self.emergency_done = False
        # kind hf: the resolved transformers config, recorded with the weights for the export.
        self.hf_config = recorded_config(cfg.model)

    def _meta(self, step: int) -> dict:
        run = self.run
        meta = {"run": run.name, "run_id": run.run_id, "step": step, "format": "elastic_trainer",
                "model": self.cfg.model.model_dump(mode="json")}
        if self.hf_config is not None:
            meta["hf_config"] = self.hf_config
        return meta

    def gather_state(self) -> dict:
        """Full model state of the last step: each stage from its first live replica (every
        replica holds the same weights), else from the snapshot of the step. Workers found gone
        are dropped (the durable and emergency saves then read only what lives). Raises
        :class:`RunError` naming each stage none of which is left."""
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
        parts = {r: (e.blocks, e.node) for r, e in snap.shards.items()}
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

    def final(self, state: dict) -> dict:
        """Write the final durable checkpoint (with storage) and ``state`` (the weights gathered
        from the live workers) to ``run.output_dir``; ``{"durable_path", "model_path"}``.

        Raises :class:`SaveError` naming what was not saved."""
        run = self.run
        missing, out = [], {"durable_path": None, "model_path": None, "hf_path": None}
        if self._writer():
            try:
                out["durable_path"] = self._final_durable()
            except Exception as e:  # noqa: BLE001 - named in the SaveError below
                missing.append(f"the final durable checkpoint of step {run.step} in "
                               f"{self.cfg.checkpoint.storage} ({type(e).__name__}: {e})")
        where = self.cfg.run.output_dir
        try:
            t0 = time.perf_counter()
            out["model_path"] = save_weights(where, state, self._meta(run.step), self.cfg.failure.storage_retries)
            run.event("weights_saved", step=run.step, path=out["model_path"], seconds=time.perf_counter() - t0,
                      tensors=len(state))
            log.info("[%s] weights of step %d saved to %s", run.name, run.step, out["model_path"])
        except WeightsError as e:
            missing.append(f"the weights ({e})")
        if self.cfg.model.kind == "hf" and not missing:
            out["hf_path"] = self._hf_folder(state, where)
        if missing:
            self.unsaved = state
            raise SaveError(f"run {run.name} trained {run.step} steps but did not save " + "; ".join(missing)
                            + ". The driver keeps the weights it could gather (error.model_state).")
        return out

    def _hf_folder(self, state: dict, where: str) -> str | None:
        """The Hugging Face folder beside the weights (``<output_dir>/hf``). Not a condition of
        FINISHED: the weights file holds the same tensors and ``export --hf`` makes it again."""
        run = self.run
        try:
            path = write_hf_folder(state, self.cfg.model, f"{where.rstrip('/')}/hf", self.hf_config)
        except Exception as e:  # noqa: BLE001 - reported; the weights file is saved
            run.event("checkpoint_problem", step=run.step, detail=f"the Hugging Face folder was not written: "
                                                                 f"{type(e).__name__}: {e}")
            return None
        log.info("[%s] Hugging Face folder at %s", run.name, path)
        return path

    def _final_durable(self) -> str:
        run = self.run
        self._writer().wait()
        topo = run.plan.topology
        live = {r: w for r, w in run.ranks.items() if w in self.pool}
        whole = len(live) == len(run.ranks)
        # With a worker gone (gather_state dropped it), only parts with a copy that lives are read.
        refs = (self._writer().shards(run.step) if whole
                else self._writer().shards(run.step, self.pool.nodes(), set(live.values())))
        if not refs:
            # The last step has no snapshot kept (none due, or dropped): export one from every
            # live rank, and write each stage's first live replica's part, whatever becomes of
            # their copies.
            exported = {w: self.pool[w].actor.export_snapshot.remote(run.step) for w in live.values()}
            if whole:
                self.snapshots.take_step(run.step, {r: self.pool[w] for r, w in live.items()}, exported, full=True)
            if self._ps():
                self._ps().snapshot(run.step)
            order = stage_replicas(topo, run.ranks, set(live.values()))
            refs = ((self._writer().shards(run.step) if whole or self._ps() else [])
                    or ([exported[ws[0]] for ws in order.values()] if all(order.values()) else []))
        if not refs:
            raise RuntimeError(f"no snapshot of step {run.step} covers every block")
        path = self._writer().write(run.step, refs, list(run.history), run.plan.describe(), raise_errors=True)
        # Read back: the files verify against the manifest's checksums.
        self.durable.load(run.step)
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
        run = self.run
        alive_nodes, alive_workers = self.pool.nodes(), set(self.pool.workers)
        for step in reversed(self.snapshots.committed_steps()):
            refs = self.snapshots.covering(step, len(run.counts), alive_nodes, alive_workers)
            if refs:
                shards = ray.get(refs, timeout=self.cfg.comm.timeout_s)
                state = weights_from_shards(shards)
                return save_weights(self.cfg.run.output_dir, state, self._meta(step), self.cfg.failure.storage_retries,
                                    name=f"model-step-{step:08d}.safetensors")
        return None
