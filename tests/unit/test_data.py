import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic_trainer.config import DataSection
from elastic_trainer.data.corpus import prepare_stdlib_corpus, write_token_parquet
from elastic_trainer.data.dataset import TokenDataset, ensure_prepared
from elastic_trainer.data.sampler import GlobalSampler
from elastic_trainer.errors import DataError

from ..conftest import SEQ_LEN


def test_corpus_is_real_stdlib_bytes(corpus_dir):
    ds = TokenDataset.open(DataSection(path=corpus_dir, seq_len=SEQ_LEN))
    assert len(ds) > 1000
    x, y = ds.sample(np.arange(len(ds)))
    assert x.shape == (len(ds), SEQ_LEN) and x.dtype == np.int64
    assert x.min() >= 0 and y.max() < 256
    text = bytes(x[:50].reshape(-1).astype(np.uint8)).decode("utf-8", errors="replace")
    assert "import" in text or "def " in text
    x, y = ds.sample(np.array([0, 3]))
    assert x.shape == (2, SEQ_LEN) and (x[:, 1:] == y[:, :-1]).all()


def test_corpus_preparation_is_deterministic(tmp_path):
    prepare_stdlib_corpus(tmp_path / "a", 32, max_bytes=64 << 10)
    prepare_stdlib_corpus(tmp_path / "b", 32, max_bytes=64 << 10)
    a = TokenDataset.open(DataSection(path=str(tmp_path / "a"), seq_len=32))
    b = TokenDataset.open(DataSection(path=str(tmp_path / "b"), seq_len=32))
    assert len(a) == len(b) and a.fingerprint()["tokens"] == b.fingerprint()["tokens"]
    assert (a.sample(np.arange(len(a)))[1] == b.sample(np.arange(len(b)))[1]).all()


def test_prepare_on_demand(tmp_path):
    cfg = DataSection(path=str(tmp_path / "c"), seq_len=8, prepare="stdlib")
    ensure_prepared(cfg)
    assert len(TokenDataset.open(cfg)) > 0


def test_longer_rows_are_packed_not_cut(tmp_path):
    write_token_parquet(np.arange(100) % 256, tmp_path / "d", row_len=20)
    ds = TokenDataset.open(DataSection(path=str(tmp_path / "d"), seq_len=9))
    assert len(ds) == 10  # 100 tokens in windows of 10, across the rows of 20
    x, y = ds.sample(np.array([2, 3]))
    assert list(x[0]) == list(range(20, 29)) and list(y[1]) == list(range(31, 40))


def test_missing_path():
    with pytest.raises(DataError, match=r"data.path\('/no/such/place'\) does not exist.*data.prepare"):
        TokenDataset.open(DataSection(path="/no/such/place"))


def test_empty_parquet(tmp_path):
    pq.write_table(pa.table({"tokens": pa.array([], type=pa.list_(pa.int32()))}), tmp_path / "e.parquet")
    with pytest.raises(DataError, match="holds no rows"):
        TokenDataset.open(DataSection(path=str(tmp_path / "e.parquet")))


def test_corrupt_parquet(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not really parquet at all")
    with pytest.raises(DataError, match="not readable Parquet"):
        TokenDataset.open(DataSection(path=str(bad)))


def test_truncated_parquet_in_a_directory(tmp_path, corpus_dir):
    import shutil
    d = tmp_path / "dir"
    shutil.copytree(corpus_dir, d)
    part = sorted(d.iterdir())[0]
    part.write_bytes(part.read_bytes()[:200])
    with pytest.raises(DataError, match="not readable Parquet"):
        TokenDataset.open(DataSection(path=str(d), seq_len=SEQ_LEN))


def test_wrong_column_and_type_and_short_rows(tmp_path):
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"data.column\('tokens'\) is not in .* columns there: \['text'\]"):
        TokenDataset.open(DataSection(path=str(tmp_path / "t.parquet")))
    with pytest.raises(DataError, match="expected a list of token ids"):
        TokenDataset.open(DataSection(path=str(tmp_path / "t.parquet"), column="text"))
    pq.write_table(pa.table({"tokens": [[1, 2, 3], [1, 2, 3, 4, 5]]}), tmp_path / "s.parquet")
    # Short rows are packed with the next: 8 tokens make one window of 4 + 1, none of 8 + 1.
    ds = TokenDataset.open(DataSection(path=str(tmp_path / "s.parquet"), seq_len=4))
    assert len(ds) == 1 and list(ds.sample([0])[0][0]) == [1, 2, 3, 1]
    with pytest.raises(DataError, match=r"holds 8 tokens in 2 rows, fewer than one window of seq_len\(8\) \+ 1 = 9"):
        TokenDataset.open(DataSection(path=str(tmp_path / "s.parquet"), seq_len=8))


def test_sampler_is_a_pure_function_of_seed_and_index():
    a, b = GlobalSampler(100, seed=3), GlobalSampler(100, seed=3)
    assert (a.rows(0, 250) == b.rows(0, 250)).all()
    assert (a.rows(90, 20) == b.rows(0, 110)[90:]).all()
    assert not (a.rows(0, 100) == GlobalSampler(100, seed=4).rows(0, 100)).all()


def test_each_epoch_sees_every_row_once():
    s = GlobalSampler(37, seed=0)
    for epoch in range(3):
        assert sorted(s.rows(epoch * 37, 37)) == list(range(37))


def test_replica_slices_tile_the_global_batch_for_any_dp():
    s = GlobalSampler(1000, seed=0)
    whole = s.rows(64, 32)
    for dp in (1, 2, 4, 8):
        parts = np.concatenate([s.replica_rows(64, 32, dp, r) for r in range(dp)])
        assert (parts == whole).all()
    # Unequal shares (balancing) tile the same global batch, in replica order.
    shares = [20, 4, 8]
    parts = [s.replica_rows(64, 32, 3, r, shares) for r in range(3)]
    assert [len(p) for p in parts] == shares and (np.concatenate(parts) == whole).all()


def test_the_order_permutes_a_corpus_that_fits_the_read_ahead_and_mixes_blocks_of_a_larger_one(corpus_dir):
    from elastic_trainer.data.splits import data_order

    small = DataSection(path=corpus_dir, seq_len=SEQ_LEN)  # 256 KiB of bytes, read-ahead 256 MiB
    ds = TokenDataset.open(small)
    assert data_order(small, ds) == (1, len(ds))  # a full permutation: nothing more to read
    tight = small.model_copy(update={"read_ahead_mb": ds.decoded_bytes / (1 << 20) / 2})
    block, mix = data_order(tight, ds)
    assert block == 16 and mix >= 16
    assert data_order(small.model_copy(update={"shuffle_mix": 4}), ds) == (16, 4)
    assert data_order(small.model_copy(update={"shuffle": False}), ds) == (1, 1)


def test_resume_refuses_another_sample_order():
    from elastic_trainer.checkpoint.compat import resume_differences

    cfg = {"data": {"path": "p"}, "model": {}, "train": {}}
    diff = resume_differences(cfg, cfg, {"rows": 10, "order": [1, 10]}, {"rows": 10, "order": [16, 32]})
    assert diff == ["data (order): checkpoint [1, 10], this run [16, 32]"]
