"""Token windows streamed from Parquet, from a local path or any pyarrow filesystem URI.

All rows of all files (sorted by path) form one token stream, cut into windows of
``seq_len + 1`` tokens. Opening reads only the Parquet footers; a sample reads the
row groups its windows overlap, into a cache of decoded row groups bounded by
``data.read_ahead_mb``, so a rank's memory for data does not grow with the corpus.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..config import DataSection
from ..errors import DataError
from ..storage.retry import with_retries
from ..storage.filesystems import open_fs
from ..storage.uris import split_secrets
from .corpus import prepare_stdlib_corpus
from .parquet_layout import group_max_id, group_tokens, list_files, read_footer, read_row_group, token_field

log = logging.getLogger(__name__)

def ensure_prepared(cfg: DataSection) -> None:
    """Build the corpus at ``cfg.path`` as ``data.prepare`` says, where it is missing: the demo's
    byte corpus ('stdlib'), or text tokenized by a recipe (``data.prepare.prepare_recipe``)."""
    if cfg.prepare is None:
        return
    fs, where = open_fs(cfg.path, "data.path")
    local = isinstance(fs, pafs.LocalFileSystem)
    if cfg.prepare == "stdlib":
        if not local:
            raise DataError(f"data.prepare('stdlib') writes a local directory; data.path({cfg.path!r}) is not local")
        if fs.get_file_info(where).type == pafs.FileType.NotFound:
            prepare_stdlib_corpus(where, cfg.seq_len)
        return
    if fs.get_file_info(where).type != pafs.FileType.NotFound:
        return   # prepared already (by the driver, another rank, or `elastic-trainer prepare-data`)
    if not local:
        raise DataError(f"data.path({cfg.path!r}) does not exist, and data.prepare writes a local directory: "
                        "run `elastic-trainer prepare-data --job JOB.yaml --out DIR`, copy DIR to data.path")
    from .prepare import prepare_recipe

    prepare_recipe(cfg.prepare, where, cfg.column)


def split_windows(n_windows: int, fraction: float) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(train_range, eval_range)``: the last ``ceil(n_windows * fraction)`` windows are held out."""
    # The epsilon keeps float noise (0.1 * 30 = 3.0000000000000004) from holding out one window more.
    held = math.ceil(n_windows * fraction - 1e-9)
    if not 0 < held < n_windows:
        raise DataError(f"holding out fraction({fraction}) of {n_windows} windows leaves "
                        f"{n_windows - held} to train on and {held} to evaluate; both need at least one "
                        f"(choose a fraction between {1 / max(n_windows, 1):.3g} and {1 - 1 / max(n_windows, 1):.3g})")
    return (0, n_windows - held), (n_windows - held, n_windows)


class TokenDataset:
    """Windows of ``seq_len + 1`` consecutive tokens of the stream of all rows of a Parquet corpus.

    Window ``w`` is tokens ``[w * (seq_len + 1), (w + 1) * (seq_len + 1))``; its input is the
    first ``seq_len`` and its target the last ``seq_len``. A corpus of rows of exactly
    ``seq_len + 1`` tokens has window ``i`` == row ``i``. Thread-safe.
    """

    def __init__(self, cfg: DataSection, fs: pafs.FileSystem, files: list[str], footers: list[pq.FileMetaData],
                 groups: list[tuple[int, int]], tokens: np.ndarray, dtypes: list[np.dtype], field: pa.Field,
                 retries: int, window_range: tuple[int, int] | None, max_token_id: int | None = None):
        self._cfg, self._field = cfg, field
        self.source = split_secrets(cfg.path)[0]   # what records and messages show
        # From the column statistics alone: None where a writer left them out.
        self.max_token_id = max_token_id
        self.column = cfg.column
        self.seq_len = cfg.seq_len
        self.schema = str(field)
        self._fs, self._files, self._footers, self._retries = fs, files, footers, retries
        self._where, self._tokens, self._dtypes = groups, tokens, dtypes  # stream row group g is file, group
        self._starts = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        self._size = [int(n) * np.dtype(dtypes[f]).itemsize for n, (f, _) in zip(tokens, groups)]
        self.total_tokens = int(self._starts[-1])
        self.decoded_bytes = int(sum(self._size))               # every row group, decoded
        self.largest_group_bytes = int(max(self._size, default=0))
        self.total_windows = self.total_tokens // (cfg.seq_len + 1)
        first, stop = window_range if window_range is not None else (0, self.total_windows)
        if not (isinstance(first, int | np.integer) and isinstance(stop, int | np.integer)
                and 0 <= first < stop <= self.total_windows):
            raise DataError(f"window_range{tuple(window_range)!r} does not fit the {self.total_windows} windows of "
                            f"data.path({cfg.path!r}); need 0 <= start < stop <= {self.total_windows}")
        self._first, self._len = int(first), int(stop - first)
        self._cap = int(cfg.read_ahead_mb * (1 << 20))
        self._cond = threading.Condition()
        self._read_lock = threading.Lock()
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()  # LRU first
        self._loading: set[int] = set()
        self._pins: Counter[int] = Counter()  # groups a sample() in progress needs
        self._soft: set[int] = set()  # groups the running prefetch wants; only a sample may evict them
        self._cached = self._reserved = self._peak = self._prefetch_gen = 0
        self._pool: ThreadPoolExecutor | None = None
        self._closed = self._warned = False

    # -- opening ------------------------------------------------------------
    @classmethod
    def open(cls, cfg: DataSection, retries: int = 3,
             window_range: tuple[int, int] | None = None) -> "TokenDataset":
        """Read the footers of the corpus at ``cfg.path`` (no rows); ``window_range=(start, stop)``
        keeps windows ``[start, stop)`` only, so sample index ``i`` is window ``start + i``.
        Storage calls are retried ``retries`` times on transient errors."""
        fs, where = open_fs(cfg.path, "data.path")
        files = list_files(fs, where, cfg, retries)

        def footer(path: str) -> pq.FileMetaData:
            try:
                return with_retries(lambda: read_footer(fs, path), f"reading the Parquet footer of {path}", retries)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, FileNotFoundError, PermissionError) as e:
                raise DataError(f"data.path({cfg.path!r}) is not readable Parquet: {path}: {e}") from None

        with ThreadPoolExecutor(max_workers=max(1, min(16, len(files)))) as pool:
            footers = list(pool.map(footer, files))
        groups, tokens, dtypes, fields, max_ids = [], [], [], [], []
        for fi, (path, md) in enumerate(zip(files, footers)):
            field, leaf = token_field(md, path, cfg, len(files))
            fields.append(field)
            dtypes.append(np.dtype(field.type.value_type.to_pandas_dtype()))
            counts = [group_tokens(md, rg, leaf, field.type, path) for rg in range(md.num_row_groups)]
            # An empty row group holds no tokens and needs no read.
            groups += [(fi, rg) for rg, n in enumerate(counts) if n]
            tokens += [n for n in counts if n]
            max_ids += [group_max_id(md, rg, leaf) for rg, n in enumerate(counts) if n]
        rows, total = sum(md.num_rows for md in footers), int(sum(tokens))
        if rows == 0:
            raise DataError(f"data.path({cfg.path!r}) holds no rows")
        if total < cfg.seq_len + 1:
            raise DataError(f"data.path({cfg.path!r}) holds {total} tokens in {rows} rows, fewer than one window "
                            f"of seq_len({cfg.seq_len}) + 1 = {cfg.seq_len + 1}; lower data.seq_len or give more data")
        return cls(cfg, fs, files, footers, groups, np.asarray(tokens, dtype=np.int64), dtypes, fields[0],
                   retries, window_range, None if None in max_ids else max(max_ids))

    def subset(self, window_range: tuple[int, int]) -> "TokenDataset":
        """Windows ``[start, stop)`` of the whole stream as a dataset of their own (sample index
        ``i`` is window ``start + i``), from the footers already read: nothing is read again."""
        return TokenDataset(self._cfg, self._fs, self._files, self._footers, self._where, self._tokens,
                            self._dtypes, self._field, self._retries, window_range, self.max_token_id)

    # -- public API ---------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def fingerprint(self) -> dict:
        """What a durable checkpoint records of the data it was trained on."""
        return {"path": self.source, "rows": len(self), "tokens": self.total_tokens,
                "files": len(self._files), "schema": self.schema}

    def windows_fingerprint(self, indices) -> int:
        """A deterministic 63-bit hash of the windows ``indices`` name, in order: equal on two ranks
        exactly when they read the same windows (up to hash collisions)."""
        w = self._windows(indices).astype(np.uint64)
        pos = np.arange(len(w), dtype=np.uint64)
        # splitmix64's finaliser over (window, position); uint64 array arithmetic wraps silently.
        x = w * np.uint64(0x9E3779B97F4A7C15) + pos * np.uint64(0xBF58476D1CE4E5B9) + np.uint64(len(w))
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        return int(np.bitwise_xor.reduce(x, initial=np.uint64(len(w)))) & ((1 << 63) - 1)

    @property
    def cached_bytes(self) -> int:
        """Decoded row-group bytes held now."""
        return self._cached

    @property
    def peak_bytes(self) -> int:
        """The most decoded row-group bytes ever held (counting those being read)."""
        return self._peak

    def sample(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)`` int64 arrays of shape ``[len(indices), seq_len]``; ``y`` is ``x`` shifted by one."""
        if self._closed:
            raise ValueError(f"the TokenDataset of {self.source!r} is closed")
        start = self._windows(indices) * (self.seq_len + 1)
        g0, g1 = self._group_spans(start)
        need = _span_union(g0, g1)
        arrays = self._acquire(need)
        try:
            out = self._assemble(start, g0, g1, arrays)
        finally:
            self._release(need)
        return out[:, :-1], out[:, 1:]

    def prefetch(self, indices) -> None:
        """Start reading, on a background thread, the row groups a later ``sample(indices)`` needs,
        as far as ``read_ahead_mb`` allows; returns at once. A newer prefetch supersedes this one."""
        g0, g1 = self._group_spans(self._windows(indices) * (self.seq_len + 1))
        need = _span_union(g0, g1).tolist()
        with self._cond:
            if self._closed:
                return
            self._prefetch_gen += 1
            gen = self._prefetch_gen
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="et-data-prefetch")
        self._pool.submit(self._prefetch_run, need, gen)

    def close(self) -> None:
        """Stop prefetching and drop the cache. Idempotent."""
        with self._cond:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        with self._cond:
            self._cache.clear()
            self._cached = 0

    def __enter__(self) -> "TokenDataset":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- locating -----------------------------------------------------------
    def _windows(self, indices) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self._len):
            bad = int(idx[(idx < 0) | (idx >= self._len)][0])
            raise IndexError(f"window index {bad} is out of range for {self._len} windows of {self.source!r}")
        return idx + self._first

    def _group_spans(self, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """First and last row group (stream numbering) each window starting at ``start`` overlaps."""
        g0 = np.searchsorted(self._starts, start, side="right") - 1
        g1 = np.searchsorted(self._starts, start + self.seq_len, side="right") - 1
        return g0, g1

    def _assemble(self, start, g0, g1, arrays) -> np.ndarray:
        w = self.seq_len + 1
        out = np.empty((len(start), w), dtype=np.int64)
        single = np.flatnonzero(g0 == g1)
        order = single[np.argsort(g0[single], kind="stable")]
        cuts = np.flatnonzero(np.diff(g0[order])) + 1
        for rows in np.split(order, cuts) if len(order) else []:
            g = int(g0[rows[0]])
            view = np.lib.stride_tricks.sliding_window_view(arrays[g], w)
            out[rows] = view[start[rows] - self._starts[g]]
        for r in np.flatnonzero(g0 != g1):  # windows straddling row groups (or files)
            pos, end, col = int(start[r]), int(start[r]) + w, 0
            for g in range(int(g0[r]), int(g1[r]) + 1):
                a, b = max(pos, self._starts[g]) - self._starts[g], min(end, self._starts[g + 1]) - self._starts[g]
                out[r, col:col + b - a] = arrays[g][a:b]
                col += b - a
        return out

    # -- the cache ----------------------------------------------------------
    def _acquire(self, need: np.ndarray) -> dict[int, np.ndarray]:
        groups = need.tolist()
        with self._cond:
            self._pins.update(groups)
            total = sum(self._size[g] for g in groups)
            if total > self._cap and not self._warned:
                self._warned = True
                log.warning("one sample of %s needs %.3g MiB of row groups, more than data.read_ahead_mb(%.3g); "
                            "reading it anyway (raise read_ahead_mb, or write smaller row groups)",
                            self.source, total / (1 << 20), self._cap / (1 << 20))
        try:
            for g in groups:
                self._ensure(g, hard=True)
            with self._cond:
                return {g: self._cache[g] for g in groups}
        except BaseException:
            self._release(need)
            raise

    def _release(self, need: np.ndarray) -> None:
        with self._cond:
            self._pins.subtract(need.tolist())
            self._pins += Counter()  # drops the zero counts

    def _ensure(self, g: int, hard: bool) -> bool:
        """Have row group ``g`` cached; False when a prefetch (``hard=False``) finds no room for it."""
        size = self._size[g]
        with self._cond:
            while True:
                if g in self._cache:
                    self._cache.move_to_end(g)
                    return True
                if g in self._loading:
                    self._cond.wait()
                    continue
                room = self._make_room(size, hard)
                if room is None:
                    self._cond.wait()  # another read in flight will free or fill its reservation
                    continue
                if not room:
                    return False
                self._loading.add(g)
                self._reserved += size
                self._peak = max(self._peak, self._cached + self._reserved)
                break
        arr = None
        try:
            arr = self._load(g)
        finally:
            with self._cond:
                self._loading.discard(g)
                self._reserved -= size
                if arr is not None:
                    self._cache[g] = arr
                    self._cached += arr.nbytes
                    self._peak = max(self._peak, self._cached + self._reserved)
                self._cond.notify_all()
        return True

    def _make_room(self, size: int, hard: bool) -> bool | None:
        """Evict least recently used groups until ``size`` more bytes fit the cap (lock held).
        True: room made, or a sample that must read over the cap; False: a prefetch that must
        stop; None: wait for a read in flight first."""
        while self._cached + self._reserved + size > self._cap:
            victim = next((k for k in self._cache if not self._pins[k] and (hard or k not in self._soft)), None)
            if victim is None:
                return (None if self._reserved else True) if hard else False
            self._cached -= self._cache.pop(victim).nbytes
        return True

    def _load(self, g: int) -> np.ndarray:
        fi, rg = self._where[g]
        path, tokens = self._files[fi], int(self._tokens[g])
        dtype = np.dtype(self._dtypes[fi])
        # One decode at a time: Arrow's transient buffers then stay those of a single row group.
        with self._read_lock:
            return with_retries(lambda: read_row_group(self._fs, path, self._footers[fi], rg, self.column,
                                                        tokens, dtype),
                                f"reading row group {rg} of {path}", self._retries)

    def _prefetch_run(self, groups: list[int], gen: int) -> None:
        with self._cond:
            self._soft = set(groups)
        try:
            for g in groups:
                if self._closed or gen != self._prefetch_gen or not self._ensure(g, hard=False):
                    break
        except Exception as e:  # noqa: BLE001 - the sample that needs the group reads it again and raises
            log.debug("prefetch of %s stopped: %s: %s", self.source, type(e).__name__, e)
        finally:
            with self._cond:
                self._soft = set()


def _span_union(g0: np.ndarray, g1: np.ndarray) -> np.ndarray:
    """Sorted unique groups of all the ranges ``[g0[i], g1[i]]``."""
    spans = g1 - g0 + 1
    if not len(spans) or spans.max() == 1:
        return np.unique(g0)
    offsets = np.arange(int(spans.sum())) - np.repeat(np.cumsum(spans) - spans, spans)
    return np.unique(np.repeat(g0, spans) + offsets)


