"""Which checkpoint ``--resume`` continues: the newest of the run named run.name, or of a run id,
or a checkpoint path. To find a run by name it reads each run's newest manifest, never another
run's shards; a directory of no run (``step-00000040``) is resumed only by its path."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from ..storage.filesystems import open_fs
from ..storage.uris import mask, split_last
from ..errors import DataError
from .durable import MANIFEST, CheckpointError, DurableStore, checkpoint_dirname, parse_dirname


@dataclass
class Resumed:
    """The checkpoint ``--resume`` read (``load_resume``)."""

    shards: list          # the parts, as the reader gave them (dicts, or object refs)
    manifest: dict
    name: str                 # its directory
    run_id: str | None        # the run that wrote it (None: a directory of no run)
    newest: bool              # no newer complete checkpoint of its run: a resume continues as that run
    problems: list[str] = field(default_factory=list)   # newer checkpoints of the run that did not verify



def runs(store: DurableStore) -> dict[str, dict]:
    """Every run with checkpoints here, by run id: ``name`` (the run name of its newest manifest
    that reads, None if none does), ``steps`` (its checkpoint directories', newest first),
    ``newest`` (its newest complete step). Reads a manifest a run, never a shard."""
    by_run: dict[str, list[tuple[int, str]]] = {}
    for step, name in store.entries(own=False):
        run = parse_dirname(name)[1]
        if run:
            by_run.setdefault(run, []).append((step, name))
    out = {run: {"name": None, "steps": [step for step, _ in dirs], "newest": None}
           for run, dirs in sorted(by_run.items())}
    for run, dirs in by_run.items():
        for step, name in dirs:
            with contextlib.suppress(CheckpointError):
                out[run].update(name=store.read_manifest(name).get("run_name"), newest=step)
                break
    return out


def load_resume(store: DurableStore, run_name: str, target: str | None = None, reader=None) -> Resumed | None:
    """The checkpoint ``--resume`` continues, read and verified: the newest of the run named
    ``run_name`` (None if no run here has that name), or of the run id ``target``, or the
    checkpoint directory ``target`` (a path in this storage, or its name). Only that run's
    checkpoints are read. An unknown id or path, a name two runs share, a path outside this
    storage raise :class:`CheckpointError` naming what is there. ``reader``: how the parts are
    read (``DurableStore.load_dir``)."""
    name = _checkpoint_name(store, target) if target is not None else None
    if name is not None:
        return _resume_dir(store, name, reader)
    known = runs(store)
    if target is not None:
        if target not in known:
            raise CheckpointError(f"no run {mask(target)!r} in {store.uri}; runs there: "
                                  + (", ".join(f"{i} ({r['name']}, newest step {r['newest']})"
                                               for i, r in known.items()) or "none"))
        run_id = target
    else:
        named = [i for i, r in known.items() if r["name"] == run_name]
        if not named:
            return None
        if len(named) > 1:
            raise CheckpointError(
                f"{len(named)} runs named {run_name!r} in {store.uri}: "
                + ", ".join(f"{i} (newest step {known[i]['newest']})" for i in named)
                + "; resume one by its id (--resume-from RUN_ID, Trainer.fit(resume=RUN_ID))")
        run_id = named[0]
    loaded = store._load_newest(lambda: [n for _, n in store.entries(own=False) if parse_dirname(n)[1] == run_id], {},
                                reader)
    if loaded is None:
        raise CheckpointError(f"run {run_id}'s checkpoints in {store.uri} were deleted while being read")
    shards, manifest, problems = loaded
    return Resumed(shards, manifest, checkpoint_dirname(manifest["step"], run_id), run_id, True, problems)


def _checkpoint_name(store: DurableStore, target: str) -> str | None:
    """The directory name of the checkpoint path ``target`` in this storage; None for a run id."""
    parent, name = split_last(target)
    if not parent and parse_dirname(name) is None:
        return None
    if parent:
        try:
            fs, root = open_fs(parent, "checkpoint")
        except DataError as e:
            raise CheckpointError(f"checkpoint path {mask(target)!r}: {e}") from None
        if type(fs) is not type(store.fs) or root.rstrip("/") != store.root.rstrip("/"):
            raise CheckpointError(
                f"checkpoint path {mask(target)!r} is not in checkpoint.storage({store.uri!r}): a resumed run "
                f"writes its checkpoints there; set checkpoint.storage to {mask(parent)!r}")
    if parse_dirname(name) is None:
        raise CheckpointError(f"{mask(target)!r} is not a checkpoint directory (step-<N>-<run id>)")
    return name


def _resume_dir(store: DurableStore, name: str, reader=None) -> Resumed:
    step, run_id = parse_dirname(name)
    entries = store.entries(own=False)
    if name not in {n for _, n in entries}:
        raise CheckpointError(f"no checkpoint {name} in {store.uri}; that run's there: "
                              + (", ".join(n for _, n in entries if run_id and parse_dirname(n)[1] == run_id) or "none"))
    shards, manifest = store.load_dir(name, reader=reader)
    newer = run_id is not None and any(s > step and parse_dirname(n)[1] == run_id and store._exists(
        f"{store._path(n)}/{MANIFEST}") for s, n in entries)
    return Resumed(shards, manifest, name, run_id, not newer)
