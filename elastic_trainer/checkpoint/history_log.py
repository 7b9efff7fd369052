"""A run's step history beside its durable checkpoints, written as the steps come: each write
adds only the records since the last one, never the whole history again.

Written into every manifest, the history made the bytes a run writes grow with the square of
its steps. Here each durable write adds a segment, ``history-<run id>/<seq>-<first>-<last>.json``,
holding the records from the first step not yet written to the checkpoint's step (after a
rollback, whose records the run made again, from the first step); the manifest names its
``history_seq``.
The history of a checkpoint is every segment up to its ``seq``, a later segment's record of a
step replacing an earlier one's (the earlier is of a timeline the run rolled back), cut at the
checkpoint's step. Segments are small and never pruned with the checkpoints they came with: a
kept checkpoint's history may start in a pruned one's time.
"""

from __future__ import annotations

import json
import threading

import pyarrow.fs as pafs

from .part_io import read_bytes

_DIR = "history-{}"


class HistoryLog:
    """The history segments of ``store``'s run (a ``DurableStore`` with a run id)."""

    def __init__(self, store):
        self.store = store
        self._lock = threading.Lock()
        self._last: tuple[int, str] | None = None   # the last record written: its step, and itself
        self._seq: int | None = None      # the last segment's number (read from storage at the first write)

    def write(self, step: int, history: list[dict]) -> int:
        """Add the records of ``history`` (the run's, up to ``step``) not yet written as a segment;
        its number, which the checkpoint's manifest names. Call before the manifest is written."""
        with self._lock:
            first = self._first(history)
            if self._seq is None:
                self._seq = max((seq for seq, _, _ in self._segments()), default=0)
            self._seq += 1
            seq = self._seq
        records = [h for h in history if first <= h["step"] <= step]
        d = self._dir()
        name = f"{d}/{seq:08d}-{first:08d}-{step:08d}.json"

        def put():
            self.store.fs.create_dir(d, recursive=True)
            with self.store.fs.open_output_stream(name) as f:
                f.write(json.dumps(records).encode())

        self.store._retry(put, f"writing {name}")
        if records:
            with self._lock:
                self._last = (records[-1]["step"], _key(records[-1]))
        return seq

    def _first(self, history: list[dict]) -> int:
        """The first step to write: the one after the last written, where that record is still the
        run's; else (the run rolled back past it and made it again, or nothing is written yet) 1."""
        if self._last is None:
            return 1
        step, key = self._last
        same = next((h for h in reversed(history) if h["step"] == step), None)
        return step + 1 if same is not None and _key(same) == key else 1

    def read(self, seq: int, step: int) -> list[dict]:
        """The history of the checkpoint of ``step`` whose manifest names segment ``seq``."""
        by_step: dict[int, dict] = {}
        for s, _, name in sorted(self._segments()):
            if s > seq:
                break
            for h in json.loads(self.store._retry(lambda: read_bytes(self.store.fs, name), f"reading {name}")):
                by_step[h["step"]] = h
        return [by_step[k] for k in sorted(by_step) if k <= step]

    def _dir(self) -> str:
        return self.store._path(_DIR.format(self.store.run_id))

    def _segments(self) -> list[tuple[int, int, str]]:
        """(seq, last step, path) of every segment written."""
        infos = self.store._retry(
            lambda: self.store.fs.get_file_info(pafs.FileSelector(self._dir(), allow_not_found=True)),
            "listing the history")
        out = []
        for info in infos:
            parts = info.base_name.removesuffix(".json").split("-")
            if info.type == pafs.FileType.File and len(parts) == 3 and all(p.isdigit() for p in parts):
                out.append((int(parts[0]), int(parts[2]), info.path))
        return out


def _key(record: dict) -> str:
    return json.dumps(record, sort_keys=True, default=str)


def manifest_history(store, manifest: dict) -> list[dict]:
    """The history a checkpoint's manifest stands for: its segments' (``history_seq``), or the list
    it carries (written before segments were)."""
    if "history_seq" in manifest:
        return HistoryLog(_as_run(store, manifest.get("run_id"))).read(manifest["history_seq"], manifest["step"])
    return manifest.get("history", [])


def _as_run(store, run_id):
    if store.run_id == run_id:
        return store
    from .durable import DurableStore

    return DurableStore(*((store.uri, run_id) + store.spec[2:]))
