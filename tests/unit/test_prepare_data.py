"""prepare-data with a tokenizer: text (Parquet, .txt, .jsonl) to list<int32> token rows."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic_trainer.cli.commands import main
from elastic_trainer.config import DataSection
from elastic_trainer.data.dataset import TokenDataset
from elastic_trainer.data.prepare import prepare_tokenized
from elastic_trainer.errors import DataError

TEXTS = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "",
    "the dog sat",
    "cats and dogs ran on the mat in the park",
] * 7


def build_tokenizer(path, eos="</s>"):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>"] + ([eos] if eos else [])
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=specials))
    tok.save(str(path))
    return tok


@pytest.fixture
def tok_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    return path, build_tokenizer(path)


def read_rows(out):
    return pq.read_table(out).column("tokens").to_pylist()


def test_tokenized_rows_end_with_eos_and_pack(tmp_path, tok_file):
    path, tok = tok_file
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), tmp_path / "in.parquet",
                   row_group_size=8)
    res = prepare_tokenized(str(tmp_path / "in.parquet"), tmp_path / "out", path, batch_rows=4,
                            rows_per_group=5, rows_per_file=10)
    eos = tok.token_to_id("</s>")
    want = [tok.encode(t).ids + [eos] for t in TEXTS if t]
    assert read_rows(tmp_path / "out") == want
    assert res["rows"] == len(want) and res["tokens"] == sum(map(len, want))
    assert res["files"] == 3 and res["eos_token"] == "</s>" and "note" not in res
    assert pq.read_schema(tmp_path / "out" / "part-00000.parquet").field("tokens").type == pa.list_(pa.int32())
    assert pq.ParquetFile(tmp_path / "out" / "part-00000.parquet").metadata.num_row_groups == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # the temp dir was renamed

    ds = TokenDataset.open(DataSection(path=str(tmp_path / "out"), seq_len=6))
    stream = np.concatenate(want)
    n = len(stream) // 7
    assert len(ds) == n
    x, y = ds.sample(np.arange(n))
    assert (x == stream[: n * 7].reshape(n, 7)[:, :-1]).all() and (y[:, -1] == stream[6: n * 7: 7]).all()


def test_txt_and_jsonl_inputs_and_eos_choices(tmp_path, tok_file):
    path, tok = tok_file
    (tmp_path / "in.txt").write_text("\n".join(TEXTS) + "\n")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"body": t, "n": 1}) + "\n" for t in TEXTS))
    prepare_tokenized(str(tmp_path / "in.txt"), tmp_path / "a", path, eos=False)
    assert read_rows(tmp_path / "a") == [tok.encode(t).ids for t in TEXTS if t]
    prepare_tokenized(str(tmp_path / "in.jsonl"), tmp_path / "b", path, column="body", eos_token="<unk>")
    assert read_rows(tmp_path / "b") == [tok.encode(t).ids + [0] for t in TEXTS if t]
    with pytest.raises(DataError, match=r"line 1 has no key column\('text'\); it has \['body', 'n'\]"):
        prepare_tokenized(str(tmp_path / "in.jsonl"), tmp_path / "c", path)
    with pytest.raises(DataError, match=r"eos_token\('<s>'\) is not in the tokenizer's vocabulary"):
        prepare_tokenized(str(tmp_path / "in.txt"), tmp_path / "c", path, eos_token="<s>")

    no_eos = tmp_path / "plain.json"
    plain = build_tokenizer(no_eos, eos=None)
    res = prepare_tokenized(str(tmp_path / "in.txt"), tmp_path / "d", no_eos)
    assert res["eos_id"] is None and "rows end without an EOS" in res["note"]
    assert read_rows(tmp_path / "d") == [plain.encode(t).ids for t in TEXTS if t]


def test_errors_name_what_was_given(tmp_path, tok_file):
    path, _ = tok_file
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "in.parquet")
    with pytest.raises(DataError, match=r"tokenizer file '.*nope.json' does not exist"):
        prepare_tokenized(str(tmp_path / "in.parquet"), tmp_path / "o", tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match=r"tokenizer file '.*bad.json' is not a `tokenizers` JSON file"):
        prepare_tokenized(str(tmp_path / "in.parquet"), tmp_path / "o", tmp_path / "bad.json")
    with pytest.raises(DataError, match=r"input\('.*missing.parquet'\) does not exist"):
        prepare_tokenized(str(tmp_path / "missing.parquet"), tmp_path / "o", path)
    with pytest.raises(DataError, match=r"column\('text'\) is not in input\(.*\); columns there: \['body'\]"):
        prepare_tokenized(str(tmp_path / "in.parquet"), tmp_path / "o", path)
    (tmp_path / "o").mkdir()
    with pytest.raises(DataError, match=r"out_dir\('.*o'\) already exists"):
        prepare_tokenized(str(tmp_path / "in.parquet"), tmp_path / "o", path, column="body")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".o.")]  # no temp dir left behind


def test_cli_prepare_data_with_a_tokenizer(tmp_path, tok_file, capsys):
    path, tok = tok_file
    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "in.parquet")
    out = tmp_path / "corpus"
    assert main(["prepare-data", "--tokenizer", str(path), "--input", str(tmp_path / "in.parquet"),
                 "--out", str(out), "--no-eos"]) == 0
    want = [tok.encode(t).ids for t in TEXTS if t]
    line = capsys.readouterr().out.strip().splitlines()[0]
    assert line == f"wrote {len(want)} rows, {sum(map(len, want))} tokens (1 files) to {out}"
    assert read_rows(out) == want
    assert main(["prepare-data", "--tokenizer", str(path), "--out", str(tmp_path / "x")]) == 2
    assert "needs --input PATH" in capsys.readouterr().err
