"""Where a re-plan restores from: the latest step every block has a source for, the durable
checkpoint loaded when it is needed, each rank's loads, and ``--resume``'s starting point.

A part of ``Recovery`` (its base class): it works on the controller's state
(workers, snapshots, the durable store) and keeps the loaded durable shards.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING

import ray

from ..checkpoint.compat import ACCEPTABLE, resume_check
from ..checkpoint.durable import CheckpointError
from ..checkpoint.resume_lookup import load_resume, runs
from ..errors import RunError
from ..retry import StorageError
from .rank_figures import RANK_FIELDS
from .restore import Load, choose_restore, newest_copies, plan_loads
from .placement import dead_nodes
from .workers import failed

if TYPE_CHECKING:
    from .controller import Controller

log = logging.getLogger(__name__)

# Queries to workers that just answered a ping (which steps they hold): a slow
# answer means a busy worker, not a lost one.
_QUERY_TIMEOUT_S = 10.0


class RestorePoints:
    ctl: "Controller"
    _durable_refs: dict
    durable_manifest: dict
    holder_reads: int
    relayed_reads: int

    # -- restore ---------------------------------------------------------------------------
    def restore_point(self) -> tuple[int, dict, dict] | None:
        """(step, block -> Source, where the blocks came from) for the latest step every block has."""
        ctl, pool = self.ctl, self.ctl.pool
        if ctl.step == 0 and ctl.resume_point is not None:
            return ctl.resume_point   # --resume, before its first set-up took
        answers = pool.ask("local_steps", list(pool.workers), _QUERY_TIMEOUT_S)
        live = {w: a for w, a in answers.items() if not failed(a)}
        # A rank that wrote its whole state into the object store kept no other copy of it.
        for w, per_step in ctl.snapshots.written(set(live)).items():
            for step, (_, blocks) in per_step.items():
                live[w][step] = sorted(set(live[w].get(step, [])) | set(blocks))
        pool.forget_dead_nodes(dead_nodes())
        snaps = ctl.snapshots.available(pool.nodes(), set(pool.workers))
        n_blocks = len(ctl.counts)
        # A parameter server's optimizer shards come back only at the steps it kept.
        allowed = ctl.ps.restorable_steps() if ctl.ps else None
        found = choose_restore(n_blocks, live, snaps, {}, max_step=ctl.step, allowed=allowed)
        durable: dict = {}
        if found is None or (ctl.durable and self._durable_step_beyond(found[0])):
            durable = self.load_durable()
            if durable:
                found = choose_restore(n_blocks, live, snaps, durable, max_step=ctl.step, allowed=allowed) or found
        if found is None:
            if ctl.step == 0:
                return None
            raise RunError(f"no step up to {ctl.step} has a source for every block"
                           + (f" at a step the parameter server kept ({sorted(allowed)})" if allowed is not None else "")
                           + f": {newest_copies(n_blocks, self._copies(live, durable))}; "
                           f"durable {'none' if not ctl.durable else 'as listed' if durable else 'unusable'}; "
                           f"after: {self.failure_summary()}")
        step, chosen = found
        tiers = collections.Counter(src.tier for src in chosen.values())
        return step, chosen, dict(tiers)

    def _copies(self, live: dict, durable: dict) -> list[tuple[int, int, str, bool]]:
        """(block, step, where, reachable) of every copy the run knows of, for the error of a
        restore that found no step whole: live workers' copies, every kept snapshot part
        (reachable or not, committed or not), the durable checkpoint's shards."""
        ctl, nodes = self.ctl, self.ctl.pool.nodes()
        out = [(b, step, f"worker {w}'s copy", True)
               for w, per in live.items() for step, blocks in per.items() for b in blocks]
        for step, snap in ctl.snapshots.snaps.items():
            for rank, e in snap.shards.items():
                ok = snap.committed_at is not None and (e.node in nodes or any(h in ctl.pool for h in e.pinned))
                where = (f"the snapshot part of rank {rank} on node {e.node[:12]}"
                         + ("" if snap.committed_at is not None else ", not committed"))
                out += [(b, step, where, ok) for b in e.blocks]
        out += [(b, step, f"durable shard {i}", True)
                for step, shards in durable.items() for i, blocks in shards.items() for b in blocks]
        return out

    def _durable_step_beyond(self, step: int) -> bool:
        try:
            steps = self.ctl.durable.steps() if self.ctl.durable else []
        except StorageError as e:
            self.ctl.event("checkpoint_problem", detail=str(e))
            return False
        return bool(steps) and steps[0] > step

    def load_durable(self, resumed=None) -> dict:
        """Load the latest durable checkpoint into the object store: ``{step: {shard: blocks}}``, or {}.

        Mid-run, the run's own newest, and a storage error is a problem noted (the run has
        other copies). ``resumed``: the checkpoint ``--resume`` read (``resume_lookup.load_resume``)."""
        ctl = self.ctl
        if resumed is not None:
            loaded = resumed.shards, resumed.manifest, resumed.problems
        else:
            try:
                loaded = ctl.durable.load_latest() if ctl.durable else None
            except (StorageError, CheckpointError) as e:
                ctl.event("checkpoint_problem", detail=str(e))
                return {}
        if not loaded:
            return {}
        shards, manifest, problems = loaded
        for p in problems:
            ctl.event("checkpoint_problem", detail=p)
        self._durable_refs = {i: ray.put(s) for i, s in enumerate(shards)}
        self.durable_manifest = manifest
        return {manifest["step"]: {i: s["blocks"] for i, s in enumerate(shards)}}

    def durable_refs(self, chosen: dict) -> list:
        """Refs of the durable shards among the sources ``chosen``."""
        return [self._durable_refs[src.shard] for src in set(chosen.values()) if src.tier == "durable"]

    def sources(self, restore: tuple, ranks: dict[int, int], plan) -> dict[int, list]:
        """Per rank, the refs (or ``("local", step)``) to load: see ``restore.plan_loads``."""
        ctl, pool = self.ctl, self.ctl.pool
        step, chosen, _ = restore
        answers = pool.ask("local_steps", list(ranks.values()), _QUERY_TIMEOUT_S)
        own = {w: ({} if failed(a) else a).get(step, []) for w, a in answers.items()}
        # Parts written by live workers at this step: their objects are those workers' copies.
        written = {w: per[step] for w, per in ctl.snapshots.written(set(pool.workers)).items() if step in per}
        loads = plan_loads(chosen, ranks, {r: plan.blocks_of(r) for r in ranks}, own,
                           {w: blocks for w, (_, blocks) in written.items()})
        self.holder_reads = self.relayed_reads = 0
        relayed: dict = {}   # (writer, step, rank): one relayed copy however many ranks read it

        def relay(writer: int, key, part_ref):
            if key not in relayed:
                self.relayed_reads += 1
                relayed[key] = pool[writer].actor.relay_part.remote([part_ref])
            return relayed[key]

        def ref(load: Load, wid: int):
            if load.kind == "local":
                return ("local", step)
            if load.kind == "written":
                # The worker's own part lies in its node's object store: loading it moves nothing.
                # Another rank reads it through its writer, never from a dead holder's copy.
                if load.worker == wid:
                    return ("own", written[wid][0])
                return relay(load.worker, ("written", load.worker), written[load.worker][0])
            if load.kind == "export":
                return pool[load.worker].actor.export_blocks.remote(step, list(load.blocks))
            if load.kind == "snapshot":
                # Where the part's node died, Ray reads its object from the dead node until it
                # declares it lost (about 30 s); a holder's pinned copy answers at once.
                holder = ctl.snapshots.live_holder(step, load.part, pool.nodes(), set(pool.workers))
                if holder is not None:
                    self.holder_reads += 1
                    return pool[holder].actor.pinned_part.remote((step, load.part))
                writer = ctl.snapshots.writer(step, load.part)
                if writer in pool.workers and writer != wid:
                    return relay(writer, ("part", load.part), ctl.snapshots.ref(step, load.part))
                return ctl.snapshots.ref(step, load.part)
            return self._durable_refs[load.shard]

        return {r: [ref(load, ranks[r]) for load in rank_loads] for r, rank_loads in loads.items()}

    def resume_source(self, request: dict | bool = True) -> tuple | None:
        """The restore point of ``--resume``, with its history. ``request`` (``compat.resume_request``,
        True for its default): the newest checkpoint of the run named run.name, or of a run id,
        or a checkpoint path. The run continues as that run (its id, its pruning), unless the
        checkpoint is an older one of it: then it is a branch, under this run's own id."""
        ctl, storage = self.ctl, self.cfg.checkpoint.storage
        if not ctl.durable:
            raise RunError("resume needs checkpoint.storage")
        request = request if isinstance(request, dict) else {}
        target, accept = request.get("target"), request.get("accept") or []
        try:
            got = load_resume(ctl.durable, ctl.run_name, target)
        except StorageError as e:
            raise RunError(f"--resume cannot read checkpoint.storage({storage!r}): {e}") from None
        except CheckpointError as e:
            raise RunError(f"--resume found no checkpoint to continue: {e}") from None
        if got is None:
            # A misspelt run.name starts fresh too: the runs there are named for the eye to catch it.
            try:
                there = ", ".join(f"{i} ({r['name']})" for i, r in runs(ctl.durable).items()) or "none"
            except StorageError as e:
                there = f"not listed: {e}"
            ctl.event("resume", detail=f"no checkpoint of a run named {ctl.run_name!r} in {storage} (runs there: "
                                       f"{there}); starting fresh")
            return None
        manifest, step = got.manifest, got.manifest["step"]
        accepted, refused = resume_check(manifest.get("config") or {}, ctl.cfg_json, manifest.get("data"), ctl.data,
                                         step, accept)
        if refused:
            may = [r.split(":")[0] for r in refused if r.split(":")[0] in ACCEPTABLE and ": checkpoint " in r]
            raise RunError(
                f"--resume refuses the checkpoint of step {step} of run {got.run_id} "
                f"({manifest.get('run_name')!r}) in {storage}: this run's config differs ({'; '.join(refused)}). "
                + (f"To take {', '.join(may)} as given, resume with --accept-change {','.join(may)} "
                   f"(Trainer.fit(accept_change={may})). " if may else "")
                + "The model, data, train.seed, train.global_batch_size, the optimizer, precision and "
                f"gradient exchange must match; dp, pp, placement and the other layout may differ; "
                f"{', '.join(ACCEPTABLE)} may change when accepted.")
        durable = self.load_durable(resumed=got)
        found = choose_restore(len(ctl.counts), {}, {}, durable)
        if found is None:
            raise RunError(f"the checkpoint {got.name} in {storage} does not cover every block of this model")
        detail = {"checkpoint": got.name, "accepted": accepted}
        if got.newest and got.run_id:
            # The resumed run continues that run: its checkpoints, its pruning.
            ctl.run_id = ctl.durable.run_id = got.run_id
        else:
            # Continuing as that run would prune its own new checkpoints behind the old run's later ones.
            detail["branched_from"] = got.run_id
        # A manifest of an older version carries per-rank figures in each record: not the history's.
        ctl.extend_history([{k: v for k, v in h.items() if k not in RANK_FIELDS} for h in manifest.get("history", [])])
        ctl.event("resume", step=found[0], source=storage, run_id=ctl.run_id, **detail)
        log.info("[%s] resuming from step %d of %s (%s)%s", ctl.run_name, found[0], storage, got.name,
                 "".join(f"; {a['field']} {a['checkpoint']!r} -> {a['run']!r}" for a in accepted))
        return found[0], found[1], {"durable": len(found[1])}
