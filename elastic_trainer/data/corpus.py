"""The demo corpus: the bytes of the Python standard library's own source files.

Every interpreter ships them, so the demo needs no download. Files are read in
sorted order, so the corpus is the same on every node running the same Python.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROWS_PER_FILE = 4096


def stdlib_source_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts
    ]
    return sorted(files)


def stdlib_bytes(max_bytes: int) -> bytes:
    chunks, total = [], 0
    for path in stdlib_source_files():
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"\n".join(chunks)[:max_bytes]


@contextlib.contextmanager
def staged_dir(out_dir: Path) -> Iterator[Path]:
    """A temporary directory beside ``out_dir``, renamed to it when the block ends, removed if
    the block raises: a reader never sees half a corpus. Where ``out_dir`` appeared meanwhile
    (another preparer finished first) that one is kept and this one dropped."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, out_dir)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not out_dir.exists():
            raise


def write_token_parquet(tokens: np.ndarray, out_dir: str | Path, row_len: int, column: str = "tokens") -> int:
    """Cut a 1-D token array into rows of ``row_len`` and write them as Parquet shards.

    Written to a temporary directory and renamed into place, so a reader never
    sees half a corpus and two preparers racing on one node cannot mix files.
    Returns the number of rows.
    """
    out_dir = Path(out_dir)
    n_rows = len(tokens) // row_len
    if n_rows == 0:
        raise ValueError(f"{len(tokens)} tokens make no row of {row_len}")
    rows = tokens[: n_rows * row_len].astype(np.int32).reshape(n_rows, row_len)
    with staged_dir(out_dir) as tmp:
        for shard, start in enumerate(range(0, n_rows, ROWS_PER_FILE)):
            block = rows[start:start + ROWS_PER_FILE]
            arr = pa.FixedSizeListArray.from_arrays(pa.array(block.reshape(-1)), row_len)
            pq.write_table(pa.table({column: arr}), tmp / f"part-{shard:05d}.parquet")
    return n_rows


def prepare_stdlib_corpus(out_dir: str | Path, seq_len: int, max_bytes: int = 8 << 20) -> int:
    """Write the stdlib byte corpus as rows of ``seq_len + 1`` byte tokens (vocabulary 256)."""
    data = np.frombuffer(stdlib_bytes(max_bytes), dtype=np.uint8)
    return write_token_parquet(data, out_dir, seq_len + 1)
