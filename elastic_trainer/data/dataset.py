"""Token sequences read from Parquet with pyarrow, from a local path or any pyarrow filesystem URI."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from ..config import DataSection
from ..errors import DataError
from .corpus import prepare_stdlib_corpus


def resolve_filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """Return the filesystem and the path inside it; plain paths are local and may be relative."""
    if "://" in path:
        try:
            return pafs.FileSystem.from_uri(path)
        except Exception as e:
            raise DataError(f"data.path({path!r}): cannot open filesystem: {e}") from None
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))


def ensure_prepared(cfg: DataSection) -> None:
    """Build the demo corpus at ``cfg.path`` if the config asks for it and it is missing."""
    if cfg.prepare != "stdlib":
        return
    fs, where = resolve_filesystem(cfg.path)
    if not isinstance(fs, pafs.LocalFileSystem):
        raise DataError(f"data.prepare('stdlib') writes a local directory; data.path({cfg.path!r}) is not local")
    if fs.get_file_info(where).type == pafs.FileType.NotFound:
        prepare_stdlib_corpus(where, cfg.seq_len)


class TokenDataset:
    """Rows of ``seq_len + 1`` token ids held in memory as one int64 array.

    Input of row i is ``rows[i, :seq_len]``; target is ``rows[i, 1:seq_len + 1]``.
    """

    def __init__(self, rows: np.ndarray, source: str, schema: str = ""):
        self.rows = rows
        self.source = source
        self.schema = schema

    def fingerprint(self) -> dict:
        """What a durable checkpoint records of the data it was trained on: path, rows, schema."""
        return {"path": self.source, "rows": len(self), "schema": self.schema}

    def __len__(self) -> int:
        return self.rows.shape[0]

    @classmethod
    def open(cls, cfg: DataSection) -> "TokenDataset":
        fs, where = resolve_filesystem(cfg.path)
        info = fs.get_file_info(where)
        if info.type == pafs.FileType.NotFound:
            hint = " (set data.prepare: stdlib to build the demo corpus there)" if cfg.prepare is None else ""
            raise DataError(f"data.path({cfg.path!r}) does not exist{hint}")
        try:
            dataset = ds.dataset(where, filesystem=fs, format="parquet", exclude_invalid_files=False)
            if cfg.column not in dataset.schema.names:
                raise DataError(
                    f"data.column({cfg.column!r}) is not in {cfg.path!r}; columns there: {dataset.schema.names}"
                )
            table = dataset.to_table(columns=[cfg.column])
        except DataError:
            raise
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"data.path({cfg.path!r}) is not readable Parquet: {e}") from None
        if table.num_rows == 0:
            raise DataError(f"data.path({cfg.path!r}) holds no rows")
        return cls(_to_rows(table.column(cfg.column), cfg), cfg.path, str(dataset.schema.field(cfg.column)))

    def sample(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = self.rows[indices]
        return rows[:, :-1], rows[:, 1:]


def _to_rows(col: pa.ChunkedArray, cfg: DataSection) -> np.ndarray:
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type) or pa.types.is_fixed_size_list(col.type)):
        raise DataError(
            f"data.column({cfg.column!r}) in {cfg.path!r} has type {col.type}; expected a list of token ids"
        )
    if not pa.types.is_integer(col.type.value_type):
        raise DataError(f"data.column({cfg.column!r}) holds {col.type.value_type}, not integer token ids")
    need = cfg.seq_len + 1
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    short = int((lengths < need).sum())
    if short:
        raise DataError(
            f"{short} of {len(lengths)} rows of {cfg.path!r} are shorter than seq_len({cfg.seq_len}) + 1 = {need} "
            f"(shortest has {int(lengths.min())})"
        )
    if (lengths == need).all():
        flat = pc.list_flatten(col).to_numpy(zero_copy_only=False)
        return flat.astype(np.int64).reshape(-1, need)
    # Rows longer than needed: keep each row's first seq_len + 1 tokens.
    return np.stack([np.asarray(r[:need], dtype=np.int64) for r in col.to_pylist()])
