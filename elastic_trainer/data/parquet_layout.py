"""The Parquet side of the token stream: the corpus's files, its footers, the token count of
each row group (from metadata alone), and reading one row group's tokens.

Nothing here holds state: ``dataset.TokenDataset`` builds its offsets from these counts and
caches what ``read_row_group`` returns.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..config import DataSection
from ..errors import DataError
from ..storage.retry import with_retries

REWRITE = "drop empty and null rows (or rewrite the corpus with `elastic-trainer prepare-data`)"


def read_footer(fs: pafs.FileSystem, path: str) -> pq.FileMetaData:
    with fs.open_input_file(path) as f, pq.ParquetFile(f) as pf:
        return pf.metadata


def read_row_group(fs: pafs.FileSystem, path: str, metadata: pq.FileMetaData, group: int, column: str,
                   tokens: int, dtype: np.dtype) -> np.ndarray:
    """The tokens of one row group as a compact array: the only place row data is read (tests fail it).

    Decoded a batch of rows at a time into an array sized from the metadata, so Arrow holds one
    page and one batch, not the row group plus its reader's buffers (2-3x the row group).
    """
    out = np.empty(tokens, dtype=dtype)
    rows = metadata.row_group(group).num_rows
    batch = int(np.clip(rows * (1 << 18) // max(tokens, 1), 16, 1 << 16))  # ~256 Ki tokens a batch
    pos = 0
    # The footer read at open saves a round trip. Closing the reader matters: left to the
    # garbage collector, its buffers outlive the read.
    with fs.open_input_file(path) as f, pq.ParquetFile(f, metadata=metadata, pre_buffer=False,
                                                              buffer_size=1 << 20) as pf:
        for b in pf.iter_batches(batch_size=batch, row_groups=[group], columns=[column], use_threads=False):
            flat = pc.list_flatten(b.column(0))
            if flat.null_count:
                raise DataError(f"{path} row group {group} holds {flat.null_count} null token ids; {REWRITE}")
            n = len(flat)
            if pos + n > tokens:
                pos += n
                break
            out[pos:pos + n] = flat.to_numpy()
            pos += n
    if pos != tokens:
        raise DataError(f"{path} row group {group}: its metadata counts {tokens} token values but its rows hold "
                        f"{'more' if pos > tokens else pos} tokens (empty or null rows make the two disagree); "
                        f"{REWRITE}")
    return out


def leaf_count(t: pa.DataType) -> int:
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return leaf_count(t.value_type)
    if pa.types.is_struct(t):
        return sum(leaf_count(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return leaf_count(t.key_type) + leaf_count(t.item_type)
    return 1


def list_files(fs: pafs.FileSystem, where: str, cfg: DataSection, retries: int) -> list[str]:
    info = with_retries(lambda: fs.get_file_info(where), f"looking up {cfg.path}", retries)
    if info.type == pafs.FileType.NotFound:
        hint = " (set data.prepare: stdlib to build the demo corpus there)" if cfg.prepare is None else ""
        raise DataError(f"data.path({cfg.path!r}) does not exist{hint}")
    if info.type != pafs.FileType.Directory:
        return [where]
    found = with_retries(lambda: fs.get_file_info(pafs.FileSelector(where, recursive=True)),
                         f"listing {cfg.path}", retries)
    root = where.rstrip("/") + "/"

    def visible(path: str) -> bool:
        # Like pyarrow's dataset discovery, and also for folders: _temporary/, .staging/ are not data.
        return not any(part.startswith((".", "_")) for part in path[len(root):].split("/"))

    files = sorted(f.path for f in found if f.type == pafs.FileType.File and visible(f.path))
    if not files:
        raise DataError(f"data.path({cfg.path!r}) is a directory with no Parquet files (names starting with "
                        f"'.' or '_' are skipped)")
    return files


def token_field(md: pq.FileMetaData, path: str, cfg: DataSection, n_files: int) -> tuple[pa.Field, int]:
    """The token column's Arrow field and the index of its leaf column chunk in the file."""
    try:
        schema = md.schema.to_arrow_schema()
    except (pa.ArrowException, ValueError) as e:
        raise DataError(f"data.path({cfg.path!r}): cannot read the schema of {path}: {e}") from None
    where = repr(cfg.path) if n_files == 1 else f"{path} (of data.path {cfg.path!r})"
    if cfg.column not in schema.names:
        raise DataError(f"data.column({cfg.column!r}) is not in {where}; columns there: {schema.names}")
    field = schema.field(cfg.column)
    t = field.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        raise DataError(f"data.column({cfg.column!r}) in {where} has type {t}; expected a list of token ids")
    if not pa.types.is_integer(t.value_type):
        raise DataError(f"data.column({cfg.column!r}) in {where} holds {t.value_type}, not integer token ids")
    leaf = sum(leaf_count(schema.field(i).type) for i in range(schema.get_field_index(cfg.column)))
    return field, leaf


def group_tokens(md: pq.FileMetaData, rg: int, leaf: int, t: pa.DataType, path: str) -> int:
    group = md.row_group(rg)
    if pa.types.is_fixed_size_list(t):
        return group.num_rows * t.list_size
    chunk = group.column(leaf)
    stats = chunk.statistics if chunk.is_stats_set else None
    # Empty and null rows count as one value each in num_values; the statistics, when written,
    # reveal them before any row is read.
    if stats is not None and stats.has_null_count and stats.null_count:
        raise DataError(f"{path} row group {rg} holds {stats.null_count} empty or null rows (or null token "
                        f"ids); {REWRITE}")
    return chunk.num_values


def group_max_id(md: pq.FileMetaData, rg: int, leaf: int) -> int | None:
    """The largest token id of a row group from its column statistics; None where none were written."""
    chunk = md.row_group(rg).column(leaf)
    stats = chunk.statistics if chunk.is_stats_set else None
    if stats is None or not stats.has_min_max:
        return None
    return int(stats.max)
