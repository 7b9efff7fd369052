"""Where a re-plan restores from: the latest step every block has a source for, the durable
checkpoint loaded when it is needed, each rank's loads, and ``--resume``'s starting point.

It reads the run's record, the workers, the snapshots and the durable store, and
keeps the loaded durable shards. What it finds it returns as values: a restore
point, each rank's sources, and for ``--resume`` the run it continues
(``Resume``: its step, its id when the run continues as that run, its history),
which the controller applies to the record.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Callable


from ...checkpoint.compat import ACCEPTABLE, resume_check
from ...checkpoint.history_log import manifest_history
from ...checkpoint.durable import CheckpointError, DurableStore
from ...checkpoint.resume_lookup import load_resume, runs
from ...config import TrainerConfig
from ...errors import RunError
from ...storage.retry import StorageError
from ...secrets import recorded_config
from ..run.rank_figures import RANK_FIELDS
from ..run.placement import dead_nodes
from .durable_parts import DurableParts
from ..run.ps_group import ParameterServers
from .restore import Load, choose_restore, newest_copies, plan_loads
from ..run.run_record import RunRecord
from .snapshots import SnapshotStore
from ..run.workers import WorkerPool
from ..run.asking import failed

log = logging.getLogger(__name__)
# The longest a re-plan between steps waits for the copies of the step just ended.
_SETTLE_S = 15.0

# Queries to workers that just answered a ping (which steps they hold): a slow
# answer means a busy worker, not a lost one.
_QUERY_TIMEOUT_S = 10.0
# A part of a durable checkpoint may take this long to read at the least (its storage calls retry within it).
_PART_READ_TIMEOUT_S = 300.0


@dataclass
class Resume:
    """What ``--resume`` continues: the restore point, the run id to continue as (None: a branch
    under this run's own id), and the history its checkpoint carried."""

    point: tuple
    run_id: str | None
    history: list[dict] = field(default_factory=list)
    data_skips: list = field(default_factory=list)   # the sample ranges that run left out (data.skips)


class RestorePoints:
    def __init__(self, cfg: TrainerConfig, cfg_json: dict, data: dict, run: RunRecord, pool: WorkerPool,
                 snapshots: SnapshotStore, durable: DurableStore | None, ps: Callable[[], ParameterServers | None]):
        self.cfg, self.cfg_json, self.data, self.run, self.pool = cfg, cfg_json, data, run, pool
        self.snapshots, self.durable, self._ps = snapshots, durable, ps
        self._durable_refs: dict = {}   # shard index -> ref of a loaded durable checkpoint
        self.durable_manifest: dict = {}
        self.holder_reads = 0    # snapshot parts the last restore read from a holder's pinned copy
        self.relayed_reads = 0   # and those it read through their live writer
        self.resume_point: tuple | None = None   # the durable restore of --resume, until the first set-up took it

    # -- restore ---------------------------------------------------------------------------
    def restore_point(self, between_steps: bool = False, at_most: int | None = None) -> tuple[int, dict, dict] | None:
        """(step, block -> Source, where the blocks came from) for the latest step every block has.
        ``between_steps``: a re-plan with every worker of the plan alive (a grow, a re-cut): the
        copies of the step just ended that are still being made are waited for, and its snapshot
        counts before it commits, so that nothing is redone. ``at_most``: no later step (after
        silent corruption, the last step every replica agreed on)."""
        run, pool = self.run, self.pool
        if run.step == 0 and self.resume_point is not None:
            return self.resume_point   # --resume, before its first set-up took
        # Bounded: a copy takes a moment, and a spare that froze (its silence unseen between steps)
        # must not hold the re-plan for the whole collective timeout.
        settle_s = min(self.cfg.comm.timeout_s, _SETTLE_S) if between_steps else 0.0
        # Every copy after run.step is of a timeline the next set-up abandons: the workers hear of it
        # here, so a copy still in flight from the failed step is refused, not kept over the ones asked for.
        answers = pool.ask("local_steps", list(pool.workers), _QUERY_TIMEOUT_S + settle_s, run.timeline_to(run.step),
                           settle_s)
        live = {w: a for w, a in answers.items() if not failed(a)}
        sealed = self.snapshots.sealed_groups(run.step, set(live), settle_s) if between_steps else {}
        # A rank that wrote its whole state into the object store kept no other copy of it.
        for w, per_step in self.snapshots.written(set(live)).items():
            for step, (_, blocks) in per_step.items():
                live[w][step] = sorted(set(live[w].get(step, [])) | set(blocks))
        pool.forget_dead_nodes(dead_nodes())
        snaps = self.snapshots.available(pool.nodes(), set(pool.workers))
        if sealed:
            snaps.setdefault(run.step, {}).update(sealed)
        n_blocks = len(run.counts)
        top = run.step if at_most is None else min(run.step, at_most)
        # A parameter server's optimizer shards come back only at the steps it kept.
        ps = self._ps()
        allowed = ps.restorable_steps() if ps else None
        found = choose_restore(n_blocks, live, snaps, {}, max_step=top, allowed=allowed)
        durable: dict = {}
        if found is None or (self.durable and self._durable_step_beyond(found[0])):
            durable = self.load_durable()
            if durable:
                found = choose_restore(n_blocks, live, snaps, durable, max_step=top, allowed=allowed) or found
        if found is None:
            if run.step == 0:
                return None
            if allowed is None and self.resume_point is None:
                # Nothing saved of any step survives (the first snapshots had not committed when
                # the loss came), and the run began from the seed: it begins from it again, the
                # steps so far run again. Nothing is lost that a restore could have kept.
                run.event("checkpoint_problem", step=run.step,
                          detail=f"no step up to {run.step} has a source for every block "
                                 f"({newest_copies(n_blocks, self._copies(live, durable))}): the run starts "
                                 "again from its seed (step 0)")
                log.warning("[%s] no saved step survives: starting again from the seed", run.name)
                return None
            raise RunError(f"no step up to {run.step} has a source for every block"
                           + (f" at a step the parameter server kept ({sorted(allowed)})" if allowed is not None else "")
                           + f": {newest_copies(n_blocks, self._copies(live, durable))}; "
                           f"durable {'none' if not self.durable else 'as listed' if durable else 'unusable'}; "
                           f"after: {run.failure_summary()}")
        step, chosen = found
        tiers = collections.Counter(src.tier for src in chosen.values())
        return step, chosen, dict(tiers)

    def _copies(self, live: dict, durable: dict) -> list[tuple[int, int, str, bool]]:
        """(block, step, where, reachable) of every copy the run knows of, for the error of a
        restore that found no step whole: live workers' copies, every kept snapshot part
        (reachable or not, committed or not), the durable checkpoint's shards."""
        nodes = self.pool.nodes()
        out = [(b, step, f"worker {w}'s copy", True)
               for w, per in live.items() for step, blocks in per.items() for b in blocks]
        for step, snap in self.snapshots.snaps.items():
            for rank, e in snap.shards.items():
                ok = snap.committed_at is not None and (e.node in nodes or any(h in self.pool for h in e.pinned))
                where = (f"the snapshot part of rank {rank} on node {e.node[:12]}"
                         + ("" if snap.committed_at is not None else ", not committed"))
                out += [(b, step, where, ok) for b in e.blocks]
        out += [(b, step, f"durable shard {i}", True)
                for step, shards in durable.items() for i, blocks in shards.items() for b in blocks]
        return out

    def _durable_step_beyond(self, step: int) -> bool:
        try:
            steps = self.durable.steps() if self.durable else []
        except StorageError as e:
            self.run.event("checkpoint_problem", detail=str(e))
            return False
        return bool(steps) and steps[0] > step

    def load_durable(self, resumed=None) -> dict:
        """Load the latest durable checkpoint into the object store, each part read and verified
        on a node (the controller holds refs): ``{step: {shard: blocks}}``, or {}.

        Mid-run, the run's own newest, and a storage error is a problem noted (the run has
        other copies). ``resumed``: the checkpoint ``--resume`` read (``resume_lookup.load_resume``)."""
        if resumed is not None:
            loaded = resumed.shards, resumed.manifest, resumed.problems
        else:
            try:
                loaded = self.durable.load_latest(reader=self._reader()) if self.durable else None
            except (StorageError, CheckpointError) as e:
                self.run.event("checkpoint_problem", detail=str(e))
                return {}
        if not loaded:
            return {}
        shards, manifest, problems = loaded
        for p in problems:
            self.run.event("checkpoint_problem", detail=p)
        # The parts were read and verified on the nodes, and stay in their object stores.
        self._durable_refs = dict(enumerate(shards))
        self.durable_manifest = manifest
        # A sharded optimizer's slices of the same blocks are one source (a tuple of files).
        files = manifest["files"]
        return {manifest["step"]: {(g[0] if len(g) == 1 else tuple(g)): files[g[0]]["blocks"]
                                   for g in DurableStore.file_groups(files)}}

    def _reader(self):
        """Reads a checkpoint's parts on the nodes, as object refs (``durable_parts``)."""
        return DurableParts(self.durable, max(_PART_READ_TIMEOUT_S, self.cfg.comm.timeout_s)).reader

    def durable_refs(self, chosen: dict) -> list:
        """Refs of the durable shards among the sources ``chosen``."""
        return [self._durable_refs[i] for src in set(chosen.values()) if src.tier == "durable"
                for i in (src.shard if isinstance(src.shard, tuple) else [src.shard])]

    def sources(self, restore: tuple, ranks: dict[int, int], plan) -> dict[int, list]:
        """Per rank, the refs (or ``("local", step)``) to load: see ``restore.plan_loads``."""
        pool, snapshots = self.pool, self.snapshots
        step, chosen, _ = restore
        answers = pool.ask("local_steps", list(ranks.values()), _QUERY_TIMEOUT_S, self.run.timeline_to(step))
        own = {w: ({} if failed(a) else a).get(step, []) for w, a in answers.items()}
        # Parts written by live workers at this step: their objects are those workers' copies.
        written = {w: per[step] for w, per in snapshots.written(set(pool.workers)).items() if step in per}
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
                writer = snapshots.writer(step, load.part)
                if writer == wid:   # a survivor's own slice: in its node's object store already
                    return ("own", snapshots.ref(step, load.part))
                # A sharded slice is cut where it lies to what the reader needs (its blocks' weights,
                # the moments' ranges it now owns): the worker asks for it once it knows its ranges.
                sliced = snapshots.sliced(step, load.part)
                # Where the part's node died, Ray reads its object from the dead node until it
                # declares it lost (about 30 s); a holder's pinned copy answers at once.
                holder = snapshots.live_holder(step, load.part, pool.nodes(), set(pool.workers))
                if holder is not None:
                    self.holder_reads += 1
                    if sliced:
                        return ("read", pool[holder].actor, "pinned_part", ((step, load.part),))
                    return pool[holder].actor.pinned_part.remote((step, load.part))
                if writer in pool.workers and sliced:
                    self.relayed_reads += 1
                    return ("read", pool[writer].actor, "relay_part", ([snapshots.ref(step, load.part)],))
                if writer in pool.workers:
                    return relay(writer, ("part", load.part), snapshots.ref(step, load.part))
                return snapshots.ref(step, load.part)
            return self._durable_refs[load.shard]

        return {r: [ref(load, ranks[r]) for load in rank_loads] for r, rank_loads in loads.items()}

    def resume_source(self, request: dict | bool = True) -> Resume | None:
        """What ``--resume`` continues (None: nothing of this run's name, a fresh start). ``request``
        (``compat.resume_request``, True for its default): the newest checkpoint of the run named
        run.name, or of a run id, or a checkpoint path. The run continues as that run (its id, its
        pruning), unless the checkpoint is an older one of it: then it is a branch, under this
        run's own id."""
        run, storage, durable_store = self.run, self.cfg.checkpoint.storage, self.durable
        if not durable_store:
            raise RunError("resume needs checkpoint.storage")
        request = request if isinstance(request, dict) else {}
        target, accept = request.get("target"), request.get("accept") or []
        try:
            got = load_resume(durable_store, run.name, target, reader=self._reader())
        except StorageError as e:
            raise RunError(f"--resume cannot read checkpoint.storage({storage!r}): {e}") from None
        except CheckpointError as e:
            raise RunError(f"--resume found no checkpoint to continue: {e}") from None
        if got is None:
            # A misspelt run.name starts fresh too: the runs there are named for the eye to catch it.
            try:
                there = ", ".join(f"{i} ({r['name']})" for i, r in runs(durable_store).items()) or "none"
            except StorageError as e:
                there = f"not listed: {e}"
            run.event("resume", detail=f"no checkpoint of a run named {run.name!r} in {storage} (runs there: "
                                       f"{there}); starting fresh")
            return None
        manifest, step = got.manifest, got.manifest["step"]
        # The manifest keeps the config as recorded (secrets masked): this run's is compared so too.
        accepted, refused = resume_check(manifest.get("config") or {}, recorded_config(self.cfg_json),
                                         manifest.get("data"), self.data, step, accept)
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
        found = choose_restore(len(run.counts), {}, {}, durable)
        if found is None:
            raise RunError(f"the checkpoint {got.name} in {storage} does not cover every block of this model")
        detail = {"checkpoint": got.name, "accepted": accepted}
        # The resumed run continues that run (its checkpoints, its pruning), unless continuing as
        # that run would prune its own new checkpoints behind the old run's later ones: a branch.
        adopt = got.run_id if got.newest and got.run_id else None
        if adopt is None:
            detail["branched_from"] = got.run_id
        run.event("resume", step=found[0], source=storage, run_id=adopt or run.run_id, **detail)
        log.info("[%s] resuming from step %d of %s (%s)%s", run.name, found[0], storage, got.name,
                 "".join(f"; {a['field']} {a['checkpoint']!r} -> {a['run']!r}" for a in accepted))
        # A manifest of an older version carries per-rank figures in each record: not the history's.
        try:
            stored = manifest_history(durable_store, manifest)
        except (OSError, StorageError, ValueError) as e:
            raise RunError(f"--resume cannot read the history of {got.name} in {storage}: {type(e).__name__}: {e}") \
                from None
        history = [{k: v for k, v in h.items() if k not in RANK_FIELDS} for h in stored]
        return Resume((found[0], found[1], {"durable": len(found[1])}), adopt, history,
                      manifest.get("data_skips") or [])
