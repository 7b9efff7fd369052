"""Durable checkpoints on any pyarrow filesystem (local path, s3://, gs://, hdfs://).

Layout under ``storage``::

    step-00000040-<run id>/shard-000.pt ...   tensors only (torch.save of dicts of tensors)
    step-00000040-<run id>/manifest.json      written last: step, run id, config, data
                                              fingerprint, files with sha256, blocks, history

Each part is written where it is, by a task on the node that holds it
(``write_part``: the controller never holds a part), and read back against
its checksum by its writer; the manifest (``commit``), written by the
controller once every part is, makes the checkpoint exist. Reading is the
same the other way: a part at a time, each verified by its reader.

Every checkpoint belongs to a run (its id is in the directory's name and the
manifest): a run prunes and restores only its own, so two runs sharing a
storage never delete or load each other's work (``resume_lookup`` finds the run
``--resume`` continues). Directories named ``step-00000040`` (no run id) are
read, never pruned, and resumed only by their path.

A prune never deletes a checkpoint that a load of the same store has open, nor
the newest complete one, and takes a manifest before its shards; a load whose
checkpoint was pruned under it all the same (by another store of the run) lists
again and reads the newest.

A directory without a manifest is half-written and ignored; a file whose
checksum does not match marks the checkpoint corrupt, and the loader reports it
and falls back to the previous one. Loading uses ``torch.load(weights_only=True)``
so a checkpoint can never run code.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import threading
import time

import pyarrow.fs as pafs
import torch

from ..storage.filesystems import open_fs
from ..storage.uris import is_uri, join, split_secrets
from ..errors import ElasticTrainerError
from ..secrets import recorded_config
from ..storage.retry import StorageError, with_retries
from .cover import cover_problems, part_spans
from .part_io import HashingWriter, read_bytes, sha256_of, to_numpy, to_torch
from .weights import not_seen

FORMAT = 1
MANIFEST = "manifest.json"
# Listings a load makes when checkpoints are pruned under it: each finds newer ones.
_LISTINGS = 4


class CheckpointError(ElasticTrainerError):
    """A durable checkpoint is missing, half-written or corrupt."""


class _Vanished(CheckpointError):
    """The checkpoint being read was deleted (pruned) meanwhile: newer ones stand in its place."""


def checkpoint_dirname(step: int, run_id: str | None = None) -> str:
    return f"step-{step:08d}" + (f"-{run_id}" if run_id else "")


def parse_dirname(name: str) -> tuple[int, str | None] | None:
    """(step, run id or None) of a checkpoint directory's name, or None if it is not one."""
    if not name.startswith("step-"):
        return None
    num, _, run = name[5:].partition("-")
    if not num.isdigit() or (run and not run.isalnum()):
        return None
    return int(num), run or None


class DurableStore:
    """The durable checkpoints under ``uri``, as seen by the run ``run_id`` (None: by none, as
    ``--resume`` looks before it adopts one). Storage errors are retried ``retries`` times."""

    def __init__(self, uri: str, run_id: str | None = None, retries: int = 3, backoff_s: float = 0.5):
        self.uri = split_secrets(uri)[0]   # what messages, events and the spec carry (open_fs keeps the credentials)
        self.run_id = run_id
        self.retries, self.backoff_s = retries, backoff_s
        self.fs, self.root = open_fs(uri, "checkpoint.storage")
        # Checkpoints a load of this store has open, and those a prune is deleting: the durable
        # writer's thread prunes while a recovery reads (restore_points.load_durable).
        self._lock = threading.Lock()
        self._open: collections.Counter[str] = collections.Counter()
        self._deleting: set[str] = set()

    def _path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def _retry(self, fn, what: str):
        return with_retries(fn, f"{what} ({self.uri})", self.retries, self.backoff_s)

    @property
    def spec(self) -> tuple:
        """What makes this store again in another process: ``DurableStore(*spec)``."""
        return self.uri, self.run_id, self.retries, self.backoff_s

    def step_dir(self, step: int) -> str:
        """The directory of this run's checkpoint of ``step``."""
        return self._path(checkpoint_dirname(step, self.run_id))

    @staticmethod
    def file_groups(files: list[dict]) -> list[list[int]]:
        """The manifest's files (indices) that load together: a sharded optimizer's slices of the
        same blocks (``sliced``) as one group, every other file alone."""
        groups: dict = {}
        for i, f in enumerate(files):
            groups.setdefault(("sliced", tuple(f["blocks"])) if f.get("sliced") else i, []).append(i)
        return list(groups.values())

    def write_part(self, step: int, index: int, shard: dict) -> dict:
        """Write one part of the checkpoint of ``step`` (``shard-<index>.pt``) and read it back
        against its checksum; its manifest entry (name, sha256, bytes, blocks), with the
        seconds it took. Run where the part is: a worker's node, never the controller."""
        if shard["step"] != step:
            raise ValueError(f"a part of step {shard['step']} given for step {step}")
        t0 = time.perf_counter()
        obj = to_torch(shard)
        d, name = self.step_dir(step), f"shard-{index:03d}.pt"
        written: dict = {}

        def write():
            # Streamed through a hash: no copy of the part is made in memory, however large.
            self.fs.create_dir(d, recursive=True)
            out = None
            try:
                with self.fs.open_output_stream(f"{d}/{name}") as f:
                    out = HashingWriter(f)
                    torch.save(obj, out)
            except Exception:
                with contextlib.suppress(OSError):   # a truncated part is no part (an object store commits on close)
                    self.fs.delete_file(f"{d}/{name}")
                # torch's zip writer may raise its own error over the storage's: the storage's says
                # whether to retry.
                if out is not None and out.error is not None:
                    raise out.error from None
                raise
            # Read back by its writer, a chunk at a time: the manifest will vouch for this checksum.
            back = sha256_of(self.fs, f"{d}/{name}")
            if back != out.sha256.hexdigest():
                raise OSError(f"{d}/{name} reads back with sha256 {back[:12]}.., written "
                              f"{out.sha256.hexdigest()[:12]}..")
            written.update(sha256=back, bytes=out.nbytes)

        self._retry(write, f"writing {d}/{name}")
        entry = {"name": name, "sha256": written["sha256"], "bytes": written["bytes"], "blocks": list(shard["blocks"]),
                 "seconds": time.perf_counter() - t0}
        if shard.get("ranges"):
            entry["sliced"] = True   # a slice of its blocks: loads with the other slices of the same blocks
            entry["spans"] = part_spans(shard)   # which moments it holds, for the cover check
        return entry

    def commit(self, step: int, files: list[dict], meta: dict, n_blocks: int | None = None) -> str:
        """Write the manifest of ``step``'s checkpoint, once every part in ``files`` (their
        ``write_part`` entries) is written: the checkpoint exists from this moment; its directory
        (``shown``). Every part
        must be there as seen from here (a local path that is not one shared filesystem holds
        each on its writer's machine): else a ``CheckpointError`` naming them, and no manifest.
        ``n_blocks``: the model's blocks, which the parts must hold whole (``cover``), else a
        ``CheckpointError`` naming what is left out, and no manifest."""
        d = self.step_dir(step)
        if n_blocks is not None and (problems := cover_problems(files, n_blocks)):
            raise CheckpointError(f"checkpoint {d} of step {step} would not hold the whole model: "
                                  + "; ".join(problems) + "; no manifest written")
        gone = self._retry(lambda: not_seen(self.fs, [f"{d}/{f['name']}" for f in files], [f["bytes"] for f in files]),
                           f"listing {d}")
        unseen = [files[i] for i in gone]
        if unseen:
            raise CheckpointError(
                f"checkpoint.storage({self.uri!r}) is not one storage for every node: "
                + "; ".join(f"{f['name']} (written on node {f.get('node', '?')})" for f in unseen)
                + f" not in {d} as seen from here; give checkpoint.storage a shared filesystem or an object "
                "store URI (s3://, gs://)")
        entries = [{k: f[k] for k in ("name", "sha256", "bytes", "blocks", "sliced", "spans") if k in f} for f in files]
        if isinstance(meta.get("config"), dict):
            # The bucket is no place for a secret: scaling.env_vars by their names only, the rest masked.
            meta = {**meta, "config": recorded_config(meta["config"])}
        manifest = {"format": FORMAT, "step": step, "run_id": self.run_id, "created": time.time(),
                    "files": entries, **meta}

        def write():
            self.fs.create_dir(d, recursive=True)
            with self.fs.open_output_stream(f"{d}/{MANIFEST}") as f:
                f.write(json.dumps(manifest).encode())

        self._retry(write, f"writing {d}/{MANIFEST}")
        return self.shown(checkpoint_dirname(step, self.run_id))

    def shown(self, name: str) -> str:
        """The checkpoint directory ``name`` as a user names it: a local path, or this store's URI
        with the name joined before its query (what ``--resume-from`` and ``export`` take)."""
        return join(self.uri, name) if is_uri(self.uri) else self._path(name)

    def save(self, step: int, shards: list[dict], meta: dict) -> str:
        """Write shards of one step (together covering every block) from this process; the
        manifest goes last. (A run writes each part where it is: ``write_part``, ``commit``.)"""
        if len({s["step"] for s in shards}) != 1 or shards[0]["step"] != step:
            raise ValueError(f"shards of steps {sorted({s['step'] for s in shards})} given for step {step}")
        return self.commit(step, [self.write_part(step, i, shard) for i, shard in enumerate(shards)], meta)

    def entries(self, own: bool = True) -> list[tuple[int, str]]:
        """(step, directory name) of the checkpoint directories (complete or not), newest step first:
        this run's (``own``, where the store has a run id) or every run's.

        A storage that cannot be listed raises :class:`StorageError`: "no checkpoints" is
        an answer only a listing that worked can give."""
        try:
            infos = self._retry(
                lambda: self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True)),
                "listing checkpoints")
        except (PermissionError, IsADirectoryError, NotADirectoryError) as e:
            raise StorageError(f"cannot list checkpoints in {self.uri}: {type(e).__name__}: {e}") from None
        out = []
        for info in infos:
            parsed = parse_dirname(info.base_name) if info.type == pafs.FileType.Directory else None
            if parsed and (not own or self.run_id is None or parsed[1] == self.run_id):
                out.append((parsed[0], info.base_name))
        return sorted(out, reverse=True)

    def steps(self) -> list[int]:
        """Steps of this run's checkpoint directories (complete or not), newest first."""
        return [step for step, _ in self.entries()]

    def load(self, step: int) -> tuple[list[dict], dict]:
        """Shards and manifest of this run's checkpoint of ``step``, every checksum verified."""
        return self.load_dir(checkpoint_dirname(step, self.run_id))

    def read_manifest(self, name: str) -> dict:
        """The manifest of the checkpoint directory ``name``."""
        d = self._path(name)
        try:
            raw = self._retry(lambda: read_bytes(self.fs, f"{d}/{MANIFEST}"), f"reading {d}/{MANIFEST}")
        except FileNotFoundError:
            if not self._exists(d):
                raise _Vanished(f"checkpoint {d} was deleted while being read") from None
            raise CheckpointError(f"checkpoint {d} has no {MANIFEST}: it was not finished") from None
        except (OSError, StorageError) as e:
            raise CheckpointError(f"checkpoint {d}: unreadable {MANIFEST}: {e}") from None
        try:
            return json.loads(raw)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {d}: unreadable {MANIFEST}: {e}") from None

    def _exists(self, path: str) -> bool:
        return self._retry(lambda: self.fs.get_file_info(path), f"reading {path}").type != pafs.FileType.NotFound

    @contextlib.contextmanager
    def _reading(self, name: str):
        """Hold ``name`` open: a prune of this store leaves it until the read ends."""
        with self._lock:
            if name in self._deleting:
                raise _Vanished(f"checkpoint {self._path(name)} is being pruned")
            self._open[name] += 1
        try:
            yield
        finally:
            with self._lock:
                self._open[name] -= 1
                if not self._open[name]:
                    del self._open[name]

    def load_dir(self, name: str, manifest: dict | None = None, reader=None) -> tuple[list, dict]:
        """Parts and manifest of the checkpoint directory ``name`` (its ``manifest`` where already
        read), every checksum verified. ``reader(store, name, manifest)``: reads the parts
        elsewhere (the controller's reads them on the nodes, as object refs); by default here."""
        with self._reading(name):
            manifest = manifest or self.read_manifest(name)
            return (reader or read_parts)(self, name, manifest), manifest

    def read_part(self, name: str, entry: dict, step: int) -> dict:
        """One part of the checkpoint directory ``name`` (its manifest ``entry``), verified."""
        d = self._path(name)
        try:
            data = self._retry(lambda: read_bytes(self.fs, f"{d}/{entry['name']}"), f"reading {d}/{entry['name']}")
        except (OSError, StorageError) as e:
            # Its manifest gone too: pruned under the reader, not a broken checkpoint.
            if isinstance(e, FileNotFoundError) and not self._exists(f"{d}/{MANIFEST}"):
                raise _Vanished(f"checkpoint {d} was deleted while being read") from None
            raise CheckpointError(f"checkpoint {d}: cannot read {entry['name']}: {e}") from None
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint {d}: {entry['name']} is corrupt (sha256 {hashlib.sha256(data).hexdigest()[:12]}.. "
                f"!= manifest {entry['sha256'][:12]}.., {len(data)} bytes vs {entry['bytes']})")
        obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        return to_numpy(obj, step, entry["blocks"])

    def load_latest(self, own: bool = True, reader=None) -> tuple[list, dict, list[str]] | None:
        """The newest checkpoint that verifies, and a note for each newer one that did not.

        ``own``: this run's, newest step first. Otherwise every run's, newest written first
        (a look at the whole storage: ``--resume`` reads one run's, see ``load_resume``)."""
        if own:
            return self._load_newest(lambda: [name for _, name in self.entries()], {}, reader)
        manifests: dict[str, dict] = {}

        def newest_written() -> list[str]:
            names = [name for _, name in self.entries(own=False)]
            for name in names:
                if name not in manifests:
                    try:
                        manifests[name] = self.read_manifest(name)
                    except CheckpointError:
                        pass   # unfinished: tried last (by load_dir), for its note
            return sorted(names, key=lambda n: manifests[n].get("created", 0.0) if n in manifests else -1.0,
                          reverse=True)

        return self._load_newest(newest_written, manifests, reader)

    def _load_newest(self, listing, manifests: dict, reader=None) -> tuple[list, dict, list[str]] | None:
        """The first checkpoint of ``listing()`` that verifies, and the problems of those before it.
        One pruned under the read means newer ones were written: the listing is made again, and
        all of it tried again (what was unfinished may be complete now)."""
        for _ in range(_LISTINGS):
            problems, vanished = [], False
            for name in listing():
                try:
                    shards, manifest = self.load_dir(name, manifests.get(name), reader)
                    return shards, manifest, problems
                except _Vanished:
                    manifests.pop(name, None)
                    vanished = True
                    break
                except CheckpointError as e:
                    problems.append(str(e))
            if not vanished:
                break
        if problems:
            raise CheckpointError(f"no usable checkpoint in {self.uri}: " + "; ".join(problems))
        return None

    def prune(self, keep: int) -> None:
        """Delete all but this run's newest ``keep`` complete checkpoints (and its older unfinished
        ones), but any that a load of this store has open. Another run's checkpoints, and those of
        no run, are never touched."""
        if self.run_id is None:
            raise ValueError("pruning needs the run id whose checkpoints it may delete")
        if keep < 1:
            raise ValueError(f"keep {keep}: a prune keeps at least the newest complete checkpoint")
        complete, doomed = 0, []
        for _, name in self.entries():
            if complete >= keep:
                doomed.append(name)
            elif self._exists(f"{self._path(name)}/{MANIFEST}"):
                complete += 1
        with self._lock:
            doomed = [name for name in doomed if name not in self._open]
            self._deleting.update(doomed)
        try:
            for name in doomed:
                d = self._path(name)
                # The manifest first: a reader that lists now sees an unfinished checkpoint, not a
                # complete one whose shards go from under it.
                with contextlib.suppress(FileNotFoundError):
                    self._retry(lambda: self.fs.delete_file(f"{d}/{MANIFEST}"), f"deleting {d}/{MANIFEST}")
                self._retry(lambda: self.fs.delete_dir(d), f"deleting {d}")
        finally:
            with self._lock:
                self._deleting.difference_update(doomed)


def read_parts(store: DurableStore, name: str, manifest: dict) -> list[dict]:
    """Every part of a checkpoint, read and verified in this process."""
    return [store.read_part(name, entry, manifest["step"]) for entry in manifest["files"]]


def write_part_here(spec: tuple, step: int, index: int, shard: dict) -> dict:
    """``DurableStore(*spec).write_part`` in this process (a worker that made the part, or a task
    on its node), its entry naming the node it was written on."""
    import ray

    entry = DurableStore(*spec).write_part(step, index, shard)
    entry["node"] = ray.get_runtime_context().get_node_id()
    return entry
