"""What a run leaves behind: at the end, the final durable checkpoint and the weights, both
verified; on the way out of a failed run, an emergency copy of the newest surviving snapshot.

A run ends FINISHED only once everything it was asked to keep is written and
read back. A save that fails ends it FAILED with :class:`SaveError`, which
names what was not saved; the controller then keeps the weights it gathered
(``unsaved``) until the driver has taken them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import ray

from ..checkpoint.weights import WeightsError, save_weights, weights_from_shards
from ..errors import RunError
from ..hf_export import recorded_config, write_hf_folder

if TYPE_CHECKING:
    from .controller import Controller

log = logging.getLogger(__name__)


class SaveError(RunError):
    """The run trained to the end but what it had to keep was not (all) saved."""


class RunSaver:
    def __init__(self, ctl: "Controller"):
        self.ctl = ctl
        self.unsaved: dict | None = None   # weights gathered for a save that failed, for the driver
        self.emergency_done = False
        # kind hf: the resolved transformers config, recorded with the weights for the export.
        self.hf_config = recorded_config(ctl.cfg.model)

    def _meta(self, step: int) -> dict:
        ctl = self.ctl
        meta = {"run": ctl.run_name, "run_id": ctl.run_id, "step": step, "format": "elastic_trainer",
                "model": ctl.cfg.model.model_dump(mode="json")}
        if self.hf_config is not None:
            meta["hf_config"] = self.hf_config
        return meta

    def gather_state(self) -> dict:
        """Full model state from replica 0's ranks (every replica holds the same weights)."""
        ctl = self.ctl
        topo = ctl.plan.topology
        refs = [ctl.pool[ctl.ranks[topo.rank(0, s)]].actor.state_dict.remote() for s in range(topo.pp)]
        out = {}
        for part in ray.get(refs, timeout=ctl.cfg.comm.timeout_s):
            out.update(part)
        return out

    def final(self, state: dict) -> dict:
        """Write the final durable checkpoint (with storage) and ``state`` (the weights gathered
        from the live workers) to ``run.output_dir``; ``{"durable_path", "model_path"}``.

        Raises :class:`SaveError` naming what was not saved."""
        ctl = self.ctl
        missing, out = [], {"durable_path": None, "model_path": None, "hf_path": None}
        if ctl.writer:
            try:
                out["durable_path"] = self._final_durable()
            except Exception as e:  # noqa: BLE001 - named in the SaveError below
                missing.append(f"the final durable checkpoint of step {ctl.step} in "
                               f"{ctl.cfg.checkpoint.storage} ({type(e).__name__}: {e})")
        where = ctl.cfg.run.output_dir
        try:
            t0 = time.perf_counter()
            out["model_path"] = save_weights(where, state, self._meta(ctl.step), ctl.cfg.failure.storage_retries)
            ctl.event("weights_saved", step=ctl.step, path=out["model_path"], seconds=time.perf_counter() - t0,
                      tensors=len(state))
            log.info("[%s] weights of step %d saved to %s", ctl.run_name, ctl.step, out["model_path"])
        except WeightsError as e:
            missing.append(f"the weights ({e})")
        if ctl.cfg.model.kind == "hf" and not missing:
            out["hf_path"] = self._hf_folder(state, where)
        if missing:
            self.unsaved = state
            raise SaveError(f"run {ctl.run_name} trained {ctl.step} steps but did not save " + "; ".join(missing)
                            + ". The driver keeps the weights it could gather (error.model_state).")
        return out

    def _hf_folder(self, state: dict, where: str) -> str | None:
        """The Hugging Face folder beside the weights (``<output_dir>/hf``). Not a condition of
        FINISHED: the weights file holds the same tensors and ``export --hf`` makes it again."""
        ctl = self.ctl
        try:
            path = write_hf_folder(state, ctl.cfg.model, f"{where.rstrip('/')}/hf", self.hf_config)
        except Exception as e:  # noqa: BLE001 - reported; the weights file is saved
            ctl.event("checkpoint_problem", step=ctl.step, detail=f"the Hugging Face folder was not written: "
                                                                 f"{type(e).__name__}: {e}")
            return None
        log.info("[%s] Hugging Face folder at %s", ctl.run_name, path)
        return path

    def _final_durable(self) -> str:
        ctl = self.ctl
        ctl.writer.wait()
        refs = ctl.writer.shards(ctl.step)
        if not refs:
            # The last step has no snapshot kept (none due, or dropped): export one from every
            # rank, and write replica 0's parts, whatever becomes of their copies.
            exported = {w: ctl.pool[w].actor.export_snapshot.remote(ctl.step) for w in ctl.ranks.values()}
            ctl.snapshots.take_step(ctl.step, {r: ctl.pool[w] for r, w in ctl.ranks.items()}, exported, full=True)
            if ctl.ps:
                ctl.ps.snapshot(ctl.step)
            topo = ctl.plan.topology
            refs = ctl.writer.shards(ctl.step) or [exported[ctl.ranks[topo.rank(0, s)]] for s in range(topo.pp)]
        if not refs:
            raise RuntimeError(f"no snapshot of step {ctl.step} covers every block")
        path = ctl.writer.write(ctl.step, refs, list(ctl.history), ctl.plan.describe(), raise_errors=True)
        # Read back: the files verify against the manifest's checksums.
        ctl.durable.load(ctl.step)
        return path

    def emergency(self, why: str) -> str | None:
        """On the way out of a failed run: save the newest committed snapshot that survives, as a
        durable checkpoint (with storage) or as weights in ``run.output_dir``. Never raises: the
        run's own error is what the user must see."""
        ctl = self.ctl
        if self.emergency_done:
            return None
        self.emergency_done = True
        try:
            if ctl.writer:
                path = ctl.writer.emergency(ctl.pool.nodes(), set(ctl.pool.workers), ctl.history,
                                            ctl.plan.describe() if ctl.plan else {})
            else:
                path = self._emergency_weights()
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.error("[%s] emergency checkpoint failed: %s: %s", ctl.run_name, type(e).__name__, e)
            ctl.event("checkpoint_problem", detail=f"emergency checkpoint failed: {type(e).__name__}: {e}")
            return None
        if path:
            ctl.event("emergency_checkpoint", path=path, reason=why[:300])
            log.warning("[%s] emergency checkpoint at %s (%s)", ctl.run_name, path, why[:200])
        return path

    def _emergency_weights(self) -> str | None:
        ctl = self.ctl
        alive_nodes, alive_workers = ctl.pool.nodes(), set(ctl.pool.workers)
        for step in reversed(ctl.snapshots.committed_steps()):
            refs = ctl.snapshots.covering(step, len(ctl.counts), alive_nodes, alive_workers)
            if refs:
                shards = ray.get(refs, timeout=ctl.cfg.comm.timeout_s)
                state = weights_from_shards(shards)
                return save_weights(ctl.cfg.run.output_dir, state, self._meta(step), ctl.cfg.failure.storage_retries,
                                    name=f"model-step-{step:08d}.safetensors")
        return None
