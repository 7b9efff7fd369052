"""The final weights, written where they are: each pipeline rank's part by a live replica of it.

Each stage's part (``model-0000k-of-0000n.safetensors``, by global name) is
written by its first live replica (``final_sources``), which reads it back
against its checksum; a stage with none left is written from the snapshot of
the last step by a task on a node that holds its parts. The controller writes
``model.safetensors.index.json`` only once every part is in, and so for the
Hugging Face folder (``<output_dir>/hf``, under Hugging Face names, with
``config.json`` and ``generation_config.json``). No process holds more than
one stage. A part that cannot be written is kept in a fallback folder on its
writer's node, and the error names each one's node and path.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ...checkpoint.weights import WeightsError, part_file, unseen_parts, weights_from_shards, write_index
from ...secrets import carrying
from ...storage.credentials import storage_env
from ...storage.uris import join
from ...config import TrainerConfig
from ...worker.weights_writer import write_stage
from .durable_parts import PART_TIMEOUT_S
from .final_sources import lost_stages_error, snapshot_cover, stage_replicas, take_stages
from ..run.run_record import RunRecord
from .snapshots import SnapshotStore
from ..run.workers import WorkerPool
from ..run.asking import ask_all

log = logging.getLogger(__name__)


class PartsNotSaved(WeightsError):
    """Parts of the weights were not written; each is kept where ``parts`` says."""

    def __init__(self, message: str, parts: list[dict]):
        super().__init__(message)
        self.parts = parts   # {"file", "stage", "node", "fallback", "error"}


def _write_from_snapshot_here(job: dict, blocks: list[int], *shards) -> dict:
    """Write ``blocks``' tensors of snapshot parts ``shards`` as ``job`` says (``write_stage``)."""
    # A bf16 parameter is stored as its bits (int16); no parameter is an int16 of its own.
    bits = {n: torch.bfloat16 for sh in shards for n, a in sh["params"].items() if a.dtype == np.int16}
    state = {n: t for n, t in weights_from_shards(list(shards), bits).items() if int(n.split(".")[1]) in blocks}
    return write_stage(state, job, ray.get_runtime_context().get_node_id())


# The storage's credentials come as the first argument: the task's runtime_env holds none.
_write_from_snapshot = ray.remote(num_cpus=0, max_retries=0)(carrying(_write_from_snapshot_here))


class FinalWeights:
    def __init__(self, cfg: TrainerConfig, run: RunRecord, pool: WorkerPool, snapshots: SnapshotStore,
                 meta: Callable[[int], dict], hf: Callable[[], tuple[dict, object] | None]):
        """``meta(step)``: what the weights record; ``hf()``: (global -> Hugging Face name, the
        transformers config) for ``model.kind: hf``, else None."""
        self.cfg, self.run, self.pool, self.snapshots, self._meta, self._hf = cfg, run, pool, snapshots, meta, hf
        self.timeout_s = max(PART_TIMEOUT_S, cfg.comm.timeout_s)

    def write(self, where: str, late: frozenset = frozenset()) -> dict:
        """Write the weights of the last step to ``where``: ``{"model_path", "hf_path", "parts"}``;
        ``late``: workers that missed a ping, asked after their stage's other replicas.
        Raises ``PartsNotSaved`` (a part failed: each kept on its node) or ``RunError`` (a stage
        has no live replica and no snapshot of the step)."""
        run, t0 = self.run, time.perf_counter()
        topo = run.plan.topology
        hf = self._hf()
        hf_where = join(where, "hf")
        meta = self._meta(run.step)

        def job(stage: int) -> dict:
            out = {"where": where, "file": part_file(stage, topo.pp), "meta": meta, "run": run.name,
                   "retries": self.cfg.failure.storage_retries, "hf": None}
            if hf is not None:
                mine = set(run.plan.blocks_of(topo.rank(0, stage)))
                out["hf"] = {"where": hf_where, "file": part_file(stage, topo.pp),
                             "names": {g: h for g, h in hf[0].items() if int(g.split(".")[1]) in mine}}
            return out

        alive = {w for w in set(run.ranks.values()) if w in self.pool}
        order = stage_replicas(topo, run.ranks, alive, late)
        def ask(asks: dict[int, int]) -> dict:
            answers = ask_all({s: self.pool[w].actor.write_weights.remote(job(s)) for s, w in asks.items()},
                              self.timeout_s)
            # A writer past its time may still be writing the file the stage's next replica will:
            # it is killed before that one starts.
            self.pool.drop([asks[s] for s, a in answers.items() if isinstance(a, TimeoutError)])
            return answers

        got, failed = take_stages(order, ask)
        answers = {s: a for s, (_, a) in got.items()}
        left = sorted(set(range(topo.pp)) - set(got))
        for s in left:
            a = self._from_snapshot(s, job(s))
            if a is not None:
                answers[s] = a
        lost = [s for s in left if s not in answers]
        if lost:
            committed = self.snapshots.committed_steps()
            raise lost_stages_error(
                run.name, run.step,
                {s: [(d, run.ranks[topo.rank(d, s)], failed.get(run.ranks[topo.rank(d, s)], "gave no answer"))
                     for d in range(topo.dp)] for s in lost},
                {s: run.plan.blocks_of(topo.rank(0, s)) for s in lost}, committed[-1] if committed else None)
        bad = [{"file": part_file(s, topo.pp), "stage": s, "node": a["node"], "fallback": a["fallback"],
                "error": a["error"]} for s, a in sorted(answers.items()) if "error" in a]
        if bad:
            raise PartsNotSaved("; ".join(
                f"{b['file']} (stage {b['stage']}): {b['error']}; "
                + (f"kept on node {b['node']} at {b['fallback']}" if b["fallback"] else f"not kept on node {b['node']}")
                for b in bad), bad)
        parts = [answers[s]["part"] for s in range(topo.pp)]
        self._check_seen(where, parts, answers)
        path = write_index(where, parts, meta, self.cfg.failure.storage_retries)
        hf_errors = [a["hf_error"] for a in answers.values() if a.get("hf_error")]
        if hf and hf_errors:
            run.event("checkpoint_problem", step=run.step,
                      detail=f"the Hugging Face folder was not written: {'; '.join(hf_errors)}")
        hf_path = (self._hf_index(hf, hf_where, [answers[s]["hf"] for s in range(topo.pp)])
                   if hf and not hf_errors else None)
        report = [{"file": p["file"], "bytes": p["bytes"], "seconds": round(p["seconds"], 3),
                   "node": answers[s]["node"]} for s, p in enumerate(parts)]
        run.event("weights_saved", step=run.step, path=path, seconds=time.perf_counter() - t0,
                  tensors=sum(len(p["names"]) for p in parts), parts=report)
        log.info("[%s] weights of step %d saved to %s (%d parts)", run.name, run.step, path, len(parts))
        return {"model_path": path, "hf_path": hf_path, "parts": report}

    def _check_seen(self, where: str, parts: list[dict], answers: dict) -> None:
        """Every part, written on its rank's node, is there for the index to name: else
        ``where`` is a local path on machines that do not share it, and the folder is split."""
        unseen = unseen_parts(where, parts)
        if unseen:
            node_of = {answers[s]["part"]["file"]: answers[s]["node"] for s in answers}
            raise PartsNotSaved(
                f"run.output_dir({where!r}) is not one storage for every node: "
                + "; ".join(f"{p['file']} was written on node {node_of[p['file']]} at {p['path']} and is not "
                            "there as seen from the controller's node" for p in unseen)
                + ". Give run.output_dir a shared filesystem or an object store URI (s3://, gs://)",
                [{"file": p["file"], "stage": None, "node": node_of[p["file"]], "fallback": p["path"],
                  "error": "not on the controller's node"} for p in unseen])

    def _from_snapshot(self, stage: int, job: dict) -> dict | None:
        """Stage ``stage``'s part written from the snapshot of the last step, by a task on a node
        holding it (None where no snapshot of the step covers it on a live node, or it fails)."""
        run = self.run
        snap = self.snapshots.snaps.get(run.step)
        if snap is None:
            return None
        blocks = run.plan.blocks_of(run.plan.topology.rank(0, stage))
        parts = {r: (e.blocks, e.node, e.group) for r, e in snap.shards.items()}
        picked = snapshot_cover(parts, set(blocks), self.pool.nodes())
        if picked is None:
            return None
        node = snap.shards[picked[0]].node
        try:
            return ray.get(_write_from_snapshot.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True)).remote(
                    storage_env(), job, blocks, *[snap.shards[r].ref for r in picked]), timeout=self.timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as e:
            log.warning("[%s] the snapshot of step %d could not stand in for stage %d: %s", run.name,
                        run.step, stage, e)
            return None

    def write_snapshot(self, step: int, where: str, n_blocks: int) -> str | None:
        """The weights of the committed snapshot of ``step`` with surviving parts, as the folder
        ``<where>/model-step-<step>``: each part written by a task on its node, then the index;
        its path, or None if no parts of ``step`` survive. Raises ``PartsNotSaved``."""
        parts = self.snapshots.covering(step, n_blocks, self.pool.nodes(), set(self.pool.workers), with_nodes=True)
        if not parts:
            return None
        folder = join(where, f"model-step-{step:08d}")
        # A sharded DP group's parts are slices of the same blocks: one file from all of them.
        files: dict = {}
        for ref, node, _, blocks, group in parts:
            files.setdefault(group if group is not None else ref, (node, blocks, []))[2].append(ref)
        parts = list(files.values())
        meta, seen, refs = self._meta(step), set(), []
        for i, (node, blocks, group_refs) in enumerate(parts):
            mine = [b for b in blocks if b not in seen]   # a block in two parts is written once
            seen |= set(mine)
            job = {"where": folder, "file": part_file(i, len(parts)), "meta": meta, "run": self.run.name,
                   "retries": self.cfg.failure.storage_retries, "hf": None}
            refs.append(_write_from_snapshot.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True)).remote(storage_env(), job, mine, *group_refs))
        answers = ray.get(refs, timeout=self.timeout_s)
        bad = [{"file": part_file(i, len(parts)), "stage": None, **a} for i, a in enumerate(answers) if "error" in a]
        if bad:
            raise PartsNotSaved("; ".join(f"{b['file']}: {b['error']}" for b in bad), bad)
        return write_index(folder, [a["part"] for a in answers], meta, self.cfg.failure.storage_retries)

    def _hf_index(self, hf: tuple, where: str, parts: list[dict]) -> str | None:
        """The Hugging Face folder's index and configs. Not a condition of FINISHED: the weights
        hold the same tensors and ``export --hf`` makes the folder again."""
        from ...checkpoint.hf_export import write_hf_configs

        try:
            path = write_index(where, parts, {}, self.cfg.failure.storage_retries)
            write_hf_configs(hf[1], where)
        except Exception as e:  # noqa: BLE001 - reported; the weights are saved
            self.run.event("checkpoint_problem", step=self.run.step,
                           detail=f"the Hugging Face folder was not written: {type(e).__name__}: {e}")
            return None
        log.info("[%s] Hugging Face folder at %s", self.run.name, path)
        return path
