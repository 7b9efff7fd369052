"""Tokenize a text corpus (Parquet, .txt, .jsonl or the stdlib's source) into the Parquet token
rows training reads, with a given tokenizer or one trained on the corpus (``data.tokenizer``).

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
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..errors import DataError
from ..secrets import mask
from ..storage.filesystems import open_fs
from .corpus import staged_dir, stdlib_source_files
from .tokenizer import check_ids_fit, load_tokenizer, train_tokenizer

# Written beside the token rows (names starting with '_' are not read as data): the tokenizer the
# rows were made with, and what a job needs to know of them (its vocabulary above all).
TOKENIZER_FILE = "_tokenizer.json"
PREPARED_FILE = "_prepared.json"
STDLIB = "stdlib"   # as an input: the Python standard library's source files, a document each

EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "<|eos|>")


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


def iter_texts(input_path: str, column: str, batch_rows: int, max_bytes: int | None = None) -> Iterator[list[str]]:
    """Batches of at most ``batch_rows`` documents: Parquet (file or directory, local or a pyarrow
    URI; ``column`` holds the text), ``.txt`` (one document per line), ``.jsonl`` (``column`` key),
    or ``stdlib`` (this Python's standard library source files, at most ``max_bytes`` of them)."""
    if input_path == STDLIB:
        yield from _batched(_stdlib_texts(8 << 20 if max_bytes is None else max_bytes), batch_rows)
        return
    fs, where = open_fs(input_path, "input")
    info = fs.get_file_info(where)
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"input({input_path!r}) does not exist")
    suffix = where.rsplit(".", 1)[-1].lower() if info.type == pafs.FileType.File else ""
    if suffix in ("txt", "jsonl"):
        yield from _batched(_line_texts(fs, where, input_path, column, suffix == "jsonl"), batch_rows)
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


def _batched(texts: Iterator[str], batch_rows: int) -> Iterator[list[str]]:
    """The non-empty ``texts`` in lists of at most ``batch_rows``."""
    batch: list[str] = []
    for text in texts:
        if text:
            batch.append(text)
        if len(batch) >= batch_rows:
            yield batch
            batch = []
    if batch:
        yield batch


def _line_texts(fs, where, input_path, column, is_json) -> Iterator[str]:
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
            yield text


def _stdlib_texts(max_bytes: int) -> Iterator[str]:
    total = 0
    for path in stdlib_source_files():   # sorted: the same documents on every node of one Python
        if total >= max_bytes:
            break
        try:
            text = path.read_text(encoding="utf-8", errors="replace")[:max_bytes - total]
        except OSError:
            continue
        total += len(text)
        yield text


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


def prepare_tokenized(input_path: str, out_dir: str | Path, tokenizer: str | Path | None = None,
                      column: str = "text", out_column: str = "tokens", eos: bool = True,
                      eos_token: str | None = None, batch_rows: int = 1024, rows_per_group: int = 2048,
                      rows_per_file: int = 131072, train: str | None = None, vocab_size: int | None = None,
                      max_bytes: int | None = None) -> dict:
    """Tokenize the documents of ``input_path`` into Parquet token rows at ``out_dir`` (local).

    The tokenizer is ``tokenizer`` (a tokenizer.json, a folder holding one, or a hub name:
    :func:`~elastic_trainer.data.tokenizer.load_tokenizer`), or, with ``train`` ('bpe' or 'unigram')
    and ``vocab_size``, one trained on the same documents first. Each non-empty document becomes
    one ``list<int32>`` row of ``out_column``: its token ids followed, if ``eos``, by the EOS id
    (``eos_token``, else a common EOS name in the vocabulary). The tokenizer is saved as
    ``_tokenizer.json`` and a summary as ``_prepared.json`` (:func:`read_prepared`) beside the rows.
    Returns ``{"rows", "tokens", "files", "path", "eos_token", "eos_id", "dropped", "vocab_size",
    "max_token_id", "tokenizer"}``, plus ``"note"`` when an EOS was asked for but the tokenizer has
    none (rows then end without one). ``max_bytes``: input ``stdlib`` only, its size cap.
    """
    for name, value in (("batch_rows", batch_rows), ("rows_per_group", rows_per_group),
                        ("rows_per_file", rows_per_file)):
        if value < 1:
            raise DataError(f"{name}({value}) must be at least 1")
    if (tokenizer is None) == (train is None):
        raise DataError(f"give one of tokenizer({tokenizer!r}) and train({train!r}): a tokenizer to use, or the "
                        "kind to train on the input")
    if (train is None) != (vocab_size is None):
        raise DataError(f"vocab_size({vocab_size}) goes with train (a trained tokenizer's size), and only with it")
    if "://" in str(out_dir):
        raise DataError(f"out_dir({str(out_dir)!r}) must be a local directory (it is written by rename)")
    out = Path(out_dir).expanduser().absolute()
    if out.exists():
        raise DataError(f"out_dir({str(out_dir)!r}) already exists; remove it or choose another")
    if train is not None:
        tok = train_tokenizer(train, vocab_size, iter_texts(str(input_path), column, batch_rows, max_bytes))
        # Encode with the tokenizer as saved, not as trained: a Unigram's scores round through its
        # JSON, and the rows must be what anyone loading _tokenizer.json gets (CI saw them differ).
        tok = type(tok).from_str(tok.to_str())
        source = f"{train.lower()} trained on {mask(str(input_path))} (vocab_size {vocab_size})"
    else:
        tok = load_tokenizer(tokenizer)
        source = str(tokenizer)
    vocab = check_ids_fit(tok, source)
    eos_name, eos_id = find_eos(tok, eos_token) if eos else (None, None)
    result = {"rows": 0, "tokens": 0, "files": 0, "path": str(out), "eos_token": eos_name, "eos_id": eos_id,
              "dropped": 0, "vocab_size": vocab, "max_token_id": -1, "tokenizer": source}
    if eos and eos_id is None:
        result["note"] = f"the tokenizer has none of {list(EOS_NAMES)}: rows end without an EOS token"
    with staged_dir(out) as tmp:
        writer = _ShardWriter(tmp, out_column, rows_per_group, rows_per_file)
        for texts in iter_texts(str(input_path), column, batch_rows, max_bytes):
            ids = [e.ids for e in tok.encode_batch(texts)]
            arr, dropped = _to_rows(ids, eos_id)
            result["dropped"] += dropped
            if len(arr):
                writer.add(arr)
                result["rows"] += len(arr)
                result["tokens"] += len(arr.values)
                result["max_token_id"] = max(result["max_token_id"], int(pc.max(arr.values).as_py()))
        writer.close()
        result["files"] = writer.files
        if result["rows"] == 0:
            raise DataError(f"input({str(input_path)!r}) gave no non-empty documents in column({column!r})")
        tok.save(str(tmp / TOKENIZER_FILE))
        summary = {k: result[k] for k in ("vocab_size", "max_token_id", "eos_token", "eos_id", "rows", "tokens",
                                          "tokenizer")}
        (tmp / PREPARED_FILE).write_text(json.dumps({**summary, "column": out_column, "dtype": "int32",
                                                     "input": mask(str(input_path))}, indent=2) + "\n")
    return result


def prepare_recipe(recipe, out_dir: str | Path, out_column: str = "tokens") -> dict:
    """Prepare ``out_dir`` as a job's ``data.prepare`` recipe (:class:`~elastic_trainer.config.PrepareSection`)
    says: its input tokenized with its tokenizer, or with one trained on the input."""
    max_bytes = None if recipe.max_mb is None else int(recipe.max_mb * (1 << 20))
    return prepare_tokenized(recipe.input, out_dir, recipe.tokenizer, column=recipe.column, out_column=out_column,
                             train=recipe.train_tokenizer, vocab_size=recipe.vocab_size, max_bytes=max_bytes)


def read_prepared(path: str | Path) -> dict | None:
    """What :func:`prepare_tokenized` recorded of the corpus at local ``path`` (its ``_prepared.json``:
    ``vocab_size``, ``max_token_id``, ``eos_id``, ``tokenizer``, ...); None where it has none."""
    f = Path(path).expanduser() / PREPARED_FILE
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def _to_rows(ids: list[list[int]], eos_id: int | None) -> tuple[pa.ListArray, int]:
    """``list<int32>`` rows of the non-empty id lists (each with ``eos_id`` appended); and how many were empty."""
    kept = [r + [eos_id] for r in ids if r] if eos_id is not None else [r for r in ids if r]
    try:
        return pa.array(kept, type=pa.list_(pa.int32())), len(ids) - len(kept)
    except (pa.ArrowInvalid, OverflowError) as e:
        raise DataError(f"token ids do not fit int32: {e}") from None
