"""Tokenize a text corpus (Parquet, .txt or .jsonl) into the Parquet token rows training reads.

Text is read and tokenized a batch at a time, so memory stays bounded by the batch
and one pending row group, not by the corpus. Output is ``list<int32>`` rows, one per
document (ending with the tokenizer's EOS id), written to a temporary directory and
renamed into place like :func:`elastic_trainer.data.corpus.write_token_parquet`.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..errors import DataError
from .corpus import staged_dir
from ..storage.filesystems import open_fs

EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "<|eos|>")


def load_tokenizer(tokenizer_file: str | Path):
    """A ``tokenizers.Tokenizer`` from its JSON file (always a local path)."""
    from tokenizers import Tokenizer

    path = Path(tokenizer_file).expanduser()
    if not path.is_file():
        raise DataError(f"tokenizer file {str(tokenizer_file)!r} does not exist (give the tokenizer.json a "
                        "`tokenizers` Tokenizer was saved to)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
        raise DataError(f"tokenizer file {str(tokenizer_file)!r} is not a `tokenizers` JSON file: {e}") from None


def find_eos(tok, eos_token: str | None = None) -> tuple[str | None, int | None]:
    """``(token, id)`` of the end-of-sequence token: ``eos_token`` if given, else the first of
    :data:`EOS_NAMES` in the vocabulary; ``(None, None)`` when there is none."""
    if eos_token is not None:
        eid = tok.token_to_id(eos_token)
        if eid is None:
            raise DataError(f"eos_token({eos_token!r}) is not in the tokenizer's vocabulary; "
                            f"tokens tried by default: {list(EOS_NAMES)}")
        return eos_token, eid
    for name in EOS_NAMES:
        eid = tok.token_to_id(name)
        if eid is not None:
            return name, eid
    return None, None


def iter_texts(input_path: str, column: str, batch_rows: int) -> Iterator[list[str]]:
    """Batches of at most ``batch_rows`` documents: Parquet (file or directory, local or a pyarrow
    URI; ``column`` holds the text), ``.txt`` (one document per line) or ``.jsonl`` (``column`` key)."""
    fs, where = open_fs(input_path, "input")
    info = fs.get_file_info(where)
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"input({input_path!r}) does not exist")
    suffix = where.rsplit(".", 1)[-1].lower() if info.type == pafs.FileType.File else ""
    if suffix in ("txt", "jsonl"):
        yield from _iter_lines(fs, where, input_path, column, batch_rows, suffix == "jsonl")
        return
    try:
        data = pads.dataset(where, filesystem=fs, format="parquet")
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"input({input_path!r}) is not readable Parquet (nor .txt or .jsonl): {e}") from None
    if column not in data.schema.names:
        raise DataError(f"column({column!r}) is not in input({input_path!r}); columns there: {data.schema.names}")
    t = data.schema.field(column).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        raise DataError(f"column({column!r}) of input({input_path!r}) has type {t}; expected text (string)")
    for batch in data.to_batches(columns=[column], batch_size=batch_rows):
        yield [s for s in batch.column(0).to_pylist() if s]


def _iter_lines(fs, where, input_path, column, batch_rows, is_json) -> Iterator[list[str]]:
    batch: list[str] = []
    with fs.open_input_stream(where) as raw:
        for lineno, line in enumerate(io.TextIOWrapper(raw, encoding="utf-8"), 1):
            if is_json:
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"input({input_path!r}) line {lineno} is not JSON: {e}") from None
                if not isinstance(doc, dict) or column not in doc:
                    keys = list(doc) if isinstance(doc, dict) else type(doc).__name__
                    raise DataError(f"input({input_path!r}) line {lineno} has no key column({column!r}); "
                                    f"it has {keys}")
                text = doc[column]
            else:
                text = line.rstrip("\r\n")
            if text:
                batch.append(text)
            if len(batch) >= batch_rows:
                yield batch
                batch = []
    if batch:
        yield batch


class _ShardWriter:
    """Rows to ``part-NNNNN.parquet`` files of ``rows_per_file`` rows (rounded up to whole row groups)
    in row groups of ``rows_per_group``."""

    def __init__(self, out: Path, column: str, rows_per_group: int, rows_per_file: int):
        self.out, self.column = out, column
        self.rows_per_group, self.rows_per_file = rows_per_group, rows_per_file
        self.files = 0
        self._writer: pq.ParquetWriter | None = None
        self._in_file = 0
        self._pending: list[pa.Array] = []
        self._pending_rows = 0
        self._type = pa.list_(pa.int32())

    def add(self, arr: pa.Array) -> None:
        self._pending.append(arr)
        self._pending_rows += len(arr)
        while self._pending_rows >= self.rows_per_group:
            self._flush(self.rows_per_group)

    def _flush(self, n: int) -> None:
        rows = pa.concat_arrays(self._pending) if len(self._pending) > 1 else self._pending[0]
        head, rest = rows.slice(0, n), rows.slice(n)
        self._pending = [rest] if len(rest) else []
        self._pending_rows = len(rest)
        if self._writer is None:
            path = self.out / f"part-{self.files:05d}.parquet"
            self._writer = pq.ParquetWriter(path, pa.schema([(self.column, self._type)]))
            self.files += 1
        self._writer.write_table(pa.table({self.column: head}), row_group_size=n)
        self._in_file += n
        if self._in_file >= self.rows_per_file:
            self._close_file()

    def _close_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer, self._in_file = None, 0

    def close(self) -> None:
        if self._pending_rows:
            self._flush(self._pending_rows)
        self._close_file()


def prepare_tokenized(input_path: str, out_dir: str | Path, tokenizer_file: str | Path, column: str = "text",
                      out_column: str = "tokens", eos: bool = True, eos_token: str | None = None,
                      batch_rows: int = 1024, rows_per_group: int = 2048, rows_per_file: int = 131072) -> dict:
    """Tokenize the documents of ``input_path`` into Parquet token rows at ``out_dir`` (local).

    Each non-empty document becomes one ``list<int32>`` row of ``out_column``: its token ids
    followed, if ``eos``, by the EOS id (``eos_token``, else a common EOS name in the vocabulary).
    Returns ``{"rows", "tokens", "files", "path", "eos_token", "eos_id", "dropped"}``, plus
    ``"note"`` when an EOS was asked for but the tokenizer has none (rows then end without one).
    """
    for name, value in (("batch_rows", batch_rows), ("rows_per_group", rows_per_group),
                        ("rows_per_file", rows_per_file)):
        if value < 1:
            raise DataError(f"{name}({value}) must be at least 1")
    if "://" in str(out_dir):
        raise DataError(f"out_dir({str(out_dir)!r}) must be a local directory (it is written by rename)")
    out = Path(out_dir).expanduser().absolute()
    if out.exists():
        raise DataError(f"out_dir({str(out_dir)!r}) already exists; remove it or choose another")
    tok = load_tokenizer(tokenizer_file)
    eos_name, eos_id = find_eos(tok, eos_token) if eos else (None, None)
    result = {"rows": 0, "tokens": 0, "files": 0, "path": str(out), "eos_token": eos_name, "eos_id": eos_id,
              "dropped": 0}
    if eos and eos_id is None:
        result["note"] = f"the tokenizer has none of {list(EOS_NAMES)}: rows end without an EOS token"
    with staged_dir(out) as tmp:
        writer = _ShardWriter(tmp, out_column, rows_per_group, rows_per_file)
        for texts in iter_texts(str(input_path), column, batch_rows):
            ids = [e.ids for e in tok.encode_batch(texts)]
            arr, dropped = _to_rows(ids, eos_id)
            result["dropped"] += dropped
            if len(arr):
                writer.add(arr)
                result["rows"] += len(arr)
                result["tokens"] += len(arr.values)
        writer.close()
        result["files"] = writer.files
        if result["rows"] == 0:
            raise DataError(f"input({str(input_path)!r}) gave no non-empty documents in column({column!r})")
    return result


def _to_rows(ids: list[list[int]], eos_id: int | None) -> tuple[pa.ListArray, int]:
    """``list<int32>`` rows of the non-empty id lists (each with ``eos_id`` appended); and how many were empty."""
    kept = [r + [eos_id] for r in ids if r] if eos_id is not None else [r for r in ids if r]
    try:
        return pa.array(kept, type=pa.list_(pa.int32())), len(ids) - len(kept)
    except (pa.ArrowInvalid, OverflowError) as e:
        raise DataError(f"token ids do not fit int32: {e}") from None
