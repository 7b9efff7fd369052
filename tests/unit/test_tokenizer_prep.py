"""Preparing text with a trained or loaded tokenizer: what is written beside the rows, the
vocabulary a job must match, and data.prepare recipes (config, ensure_prepared, prepare-data --job)."""

import json

import pyarrow.parquet as pq
import pytest
import yaml

from elastic_trainer.cli.commands import main
from elastic_trainer.config import DataSection, TrainerConfig
from elastic_trainer.data.dataset import TokenDataset, ensure_prepared
from elastic_trainer.data.prepare import prepare_tokenized, read_prepared
from elastic_trainer.data.tokenizer import TRAINED_EOS, load_tokenizer
from elastic_trainer.errors import ConfigError, DataError

SMALL = 96 << 10   # bytes of stdlib source: a BPE of 512 trains on it in well under a second


def rows(out):
    return pq.read_table(out).column("tokens").to_pylist()


def test_a_trained_bpe_is_saved_beside_rows_it_encodes(tmp_path):
    res = prepare_tokenized("stdlib", tmp_path / "a", train="BPE", vocab_size=512, max_bytes=SMALL)
    tok = load_tokenizer(tmp_path / "a" / "_tokenizer.json")
    eos = tok.token_to_id(TRAINED_EOS)
    info = read_prepared(tmp_path / "a")
    assert info["vocab_size"] == res["vocab_size"] == tok.get_vocab_size() == 512
    assert info["eos_id"] == eos and info["dtype"] == "int32"
    got = rows(tmp_path / "a")
    assert len(got) == res["rows"] == info["rows"] and all(r[-1] == eos for r in got)
    assert info["max_token_id"] == max(max(r) for r in got) < 512
    # The rows decode back to the source text (byte-level BPE loses nothing).
    from elastic_trainer.data.prepare import iter_texts
    first = next(iter_texts("stdlib", "text", 1, SMALL))[0]
    assert tok.decode(got[0][:-1]) == first
    # Trained again on the same text: the same tokenizer (each node may train its own).
    prepare_tokenized("stdlib", tmp_path / "b", train="bpe", vocab_size=512, max_bytes=SMALL)
    assert (tmp_path / "a" / "_tokenizer.json").read_text() == (tmp_path / "b" / "_tokenizer.json").read_text()
    assert rows(tmp_path / "b") == got


def test_unigram_and_a_tokenizer_folder(tmp_path):
    prepare_tokenized("stdlib", tmp_path / "u", train="unigram", vocab_size=300, max_bytes=SMALL)
    info = read_prepared(tmp_path / "u")
    assert info["vocab_size"] <= 300 and info["max_token_id"] < info["vocab_size"]
    # A Hugging Face model folder: its tokenizer.json is the one used.
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((tmp_path / "u" / "_tokenizer.json").read_text())
    prepare_tokenized("stdlib", tmp_path / "f", str(folder), max_bytes=SMALL)
    assert rows(tmp_path / "f") == rows(tmp_path / "u")
    with pytest.raises(DataError, match=r"tokenizer folder '.*' holds no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_errors_name_what_was_given(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)   # as on a machine with no internet
    with pytest.raises(DataError, match=r"tokenizer 'gpt2' .* could not be fetched .*\(--train-tokenizer bpe"):
        load_tokenizer("gpt2")
    with pytest.raises(DataError, match=r"vocab_size\(100\) must be between 257 and"):
        prepare_tokenized("stdlib", tmp_path / "x", train="bpe", vocab_size=100)
    with pytest.raises(DataError, match=r"give one of tokenizer\(.*\) and train"):
        prepare_tokenized("stdlib", tmp_path / "x")
    with pytest.raises(DataError, match=r"vocab_size\(None\) goes with train"):
        prepare_tokenized("stdlib", tmp_path / "x", train="bpe")
    assert not (tmp_path / "x").exists()


def job(tmp_path, **model) -> dict:
    return {"model": {"kind": "gpt", "n_layer": 1, "n_head": 1, "d_model": 8, **model},
            "data": {"path": str(tmp_path / "data"), "seq_len": 16,
                     "prepare": {"input": "stdlib", "max_mb": 0.05, "train_tokenizer": "bpe", "vocab_size": 400}}}


def test_recipe_checks_the_model_vocabulary(tmp_path):
    assert TrainerConfig.model_validate(job(tmp_path, vocab_size=400)).data.prepare.vocab_size == 400
    with pytest.raises(ConfigError, match=r"model.vocab_size\(256\) is smaller than the tokenizer data.prepare "
                                          r"trains \(vocab_size 400\)"):
        TrainerConfig.from_dict(job(tmp_path))
    hf = {"kind": "hf", "hf_config": {"model_type": "llama", "vocab_size": 300}}
    with pytest.raises(ConfigError, match=r"model.hf_config.vocab_size\(300\) is smaller"):
        TrainerConfig.from_dict({**job(tmp_path), "model": hf})
    both = job(tmp_path, vocab_size=400)
    both["data"]["prepare"]["tokenizer"] = "gpt2"
    with pytest.raises(ConfigError, match=r"needs one of tokenizer\('gpt2'\) and train_tokenizer\('bpe'\)"):
        TrainerConfig.from_dict(both)


def test_ensure_prepared_follows_the_recipe_once(tmp_path):
    cfg = TrainerConfig.model_validate(job(tmp_path, vocab_size=400)).data
    ensure_prepared(cfg)
    made = (tmp_path / "data" / "_prepared.json").stat().st_mtime_ns
    ensure_prepared(cfg)   # there already: left as it is
    assert (tmp_path / "data" / "_prepared.json").stat().st_mtime_ns == made
    with TokenDataset.open(cfg) as ds:   # the tokenizer and summary beside the rows are not read as data
        assert ds.max_token_id == read_prepared(tmp_path / "data")["max_token_id"] < 400
        assert ds.total_tokens == read_prepared(tmp_path / "data")["tokens"]
    remote = DataSection(path="s3://bucket/corpus", prepare=cfg.prepare)
    with pytest.raises(DataError, match=r"writes a local directory: run `elastic-trainer prepare-data --job"):
        ensure_prepared(remote.model_copy(update={"path": "mock://nowhere/corpus"}))


def test_cli_prepare_data_trains_and_follows_a_job(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["prepare-data", "--input", "stdlib", "--max-mb", "0.05", "--train-tokenizer", "BPE",
                 "--vocab-size", "400", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("wrote ") and lines[1].startswith("tokenizer: bpe trained on stdlib")
    assert json.loads((out / "_prepared.json").read_text())["vocab_size"] == 400
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job(tmp_path, vocab_size=400)))
    assert main(["prepare-data", "--job", str(path)]) == 0
    assert rows(tmp_path / "data") == rows(out)
    assert main(["prepare-data", "--job", "jobs/demo.yaml", "--out", str(tmp_path / "d")]) == 2
    assert "not a tokenizing recipe" in capsys.readouterr().err
