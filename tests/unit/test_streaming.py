"""The streaming TokenDataset (packing, bounded memory, retries) and the sampler's shuffle with locality."""

import logging
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic_trainer.config import DataSection
from elastic_trainer.data import dataset as dataset_mod
from elastic_trainer.data.corpus import write_token_parquet
from elastic_trainer.data.dataset import TokenDataset, split_windows
from elastic_trainer.data.sampler import GlobalSampler
from elastic_trainer.errors import DataError
from elastic_trainer.storage.retry import StorageError

MiB = 1 << 20


def write_rows(path, rows, row_group_size, type_=pa.list_(pa.int32()), column="tokens", **kw):
    pq.write_table(pa.table({column: pa.array(rows, type=type_)}), path, row_group_size=row_group_size, **kw)


def random_corpus(d, rng, files=3, rows=120, max_len=40, type_=pa.list_(pa.int32()), dtype=np.int32):
    """Files of rows of random lengths; returns the reference stream (plain numpy concatenation)."""
    d.mkdir(exist_ok=True)
    every = []
    for f in range(files):
        part = [rng.integers(0, 30000, rng.integers(1, max_len)).astype(dtype) for _ in range(rows)]
        every += part
        write_rows(d / f"part-{f:03d}.parquet", part, row_group_size=int(rng.integers(5, 40)), type_=type_)
    return np.concatenate(every).astype(np.int64)


def windows(stream, seq_len):
    n = len(stream) // (seq_len + 1)
    return stream[: n * (seq_len + 1)].reshape(n, seq_len + 1)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr("elastic_trainer.storage.retry.time.sleep", lambda s: None)


@pytest.mark.parametrize("type_,dtype", [(pa.list_(pa.int32()), np.int32), (pa.large_list(pa.int64()), np.int64),
                                         (pa.list_(pa.uint16()), np.uint16)])
def test_packing_matches_numpy_concatenation(tmp_path, type_, dtype):
    rng = np.random.default_rng(1)
    ref = windows(random_corpus(tmp_path / "c", rng, type_=type_, dtype=dtype), 23)
    ds = TokenDataset.open(DataSection(path=str(tmp_path / "c"), seq_len=23, read_ahead_mb=0.01))
    assert len(ds) == len(ref)
    assert ds.fingerprint()["files"] == 3 and ds.fingerprint()["rows"] == len(ref)
    idx = rng.permutation(len(ds))
    x, y = ds.sample(idx)
    assert x.dtype == np.int64 and x.shape == (len(ds), 23)
    assert (x == ref[idx, :-1]).all() and (y == ref[idx, 1:]).all()
    # Windows straddle row groups and files: row groups of 5..40 rows of 1..40 tokens, windows of 24.
    g0, g1 = ds._group_spans(np.arange(len(ds)) * 24)
    assert (g1 > g0).sum() > 10 and (g1 - g0).max() >= 1
    assert ds.peak_bytes <= ds._cap or ds._warned


def test_fixed_rows_of_a_window_give_window_equals_row(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 256, 17 * 5000)
    write_token_parquet(tokens, tmp_path / "f", row_len=17)
    ds = TokenDataset.open(DataSection(path=str(tmp_path / "f"), seq_len=16))
    rows = pq.read_table(tmp_path / "f").column("tokens").to_pylist()
    assert len(ds) == len(rows) == 5000
    assert "fixed_size_list" in ds.fingerprint()["schema"]
    for i in (0, 1, 4095, 4096, 4999):  # 4096 is the first row of the second file
        x, y = ds.sample([i])
        assert list(x[0]) == rows[i][:16] and list(y[0]) == rows[i][1:]


def test_single_file_uri_and_hidden_files(tmp_path):
    rng = np.random.default_rng(2)
    ref = windows(random_corpus(tmp_path / "c", rng, files=2), 7)
    (tmp_path / "c" / "_SUCCESS").write_text("")
    (tmp_path / "c" / ".part-x.parquet.crc").write_text("junk")
    (tmp_path / "c" / "_temporary").mkdir()
    (tmp_path / "c" / "_temporary" / "p.parquet").write_text("junk")
    ds = TokenDataset.open(DataSection(path=f"file://{tmp_path / 'c'}", seq_len=7))
    assert len(ds) == len(ref) and (ds.sample([len(ref) - 1])[1][0] == ref[-1, 1:]).all()
    one = TokenDataset.open(DataSection(path=str(tmp_path / "c" / "part-001.parquet"), seq_len=7))
    assert one.fingerprint()["files"] == 1


def test_streams_a_corpus_several_times_its_memory_cap(tmp_path, monkeypatch):
    """~24 MB of int32 tokens in row groups of ~0.9 MB, read end to end under a 4 MiB cap."""
    seq_len, rng = 255, np.random.default_rng(3)
    (tmp_path / "big").mkdir()
    parts = []
    for f in range(6):
        lengths = rng.integers(64, 2000, 4000)
        flat = rng.integers(0, 50000, int(lengths.sum()), dtype=np.int32)
        parts.append(flat)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
        pq.write_table(pa.table({"tokens": arr}), tmp_path / "big" / f"p{f}.parquet", row_group_size=220)
    ref = windows(np.concatenate(parts).astype(np.int64), seq_len)
    assert ref.nbytes // 2 > 20 * MiB  # the int32 corpus is over five times the cap
    cap = 4 * MiB
    ds = TokenDataset.open(DataSection(path=str(tmp_path / "big"), seq_len=seq_len, read_ahead_mb=4))
    assert max(ds._size) < MiB and len(ds._size) > 24
    reads, arrow, held, stop = [], [0], [0], threading.Event()
    read = dataset_mod.read_row_group

    def counted(*a):
        reads.append(a[3])
        return read(*a)

    def watch():  # samples what Arrow and the cache hold while the reads run
        while not stop.is_set():
            now = pa.total_allocated_bytes()
            arrow[0], held[0] = max(arrow[0], now), max(held[0], now + ds.cached_bytes)
            stop.wait(0.0002)

    monkeypatch.setattr(dataset_mod, "read_row_group", counted)
    watcher = threading.Thread(target=watch)
    watcher.start()
    sampler = GlobalSampler(len(ds), seed=5, block=256, mix=2)
    gb, seen = 64, []
    for step in range(len(ds) // gb):
        idx = sampler.rows(step * gb, gb)
        x, y = ds.sample(idx)
        ds.prefetch(sampler.rows((step + 1) * gb, gb))
        assert (x == ref[idx, :-1]).all() and (y == ref[idx, 1:]).all()
        assert ds.cached_bytes <= cap
        seen.append(idx)
    stop.set()
    watcher.join()
    ds.close()
    assert len(np.unique(np.concatenate(seen))) == (len(ds) // gb) * gb
    assert 0 < ds.peak_bytes <= cap
    # The cache is numpy; Arrow holds only what one read decodes (one read at a time): the
    # compressed column chunk, a page and a batch, about 3.5x a row group of under 1 MiB.
    print(f"arrow peak {arrow[0] / MiB:.2f} MiB, arrow + cache {held[0] / MiB:.2f} MiB")
    assert 0 < arrow[0] < 4 * max(ds._size) < cap
    assert held[0] < cap + 2.5 * MiB, held[0]
    # Locality: a row group holds ~3.5 blocks and is read about once per block an epoch (a full
    # permutation would read ~50 row groups per step, ~18000 in all).
    assert len(reads) < 6 * len(ds._size)


def test_one_request_over_the_cap_is_read_anyway_with_one_warning(tmp_path, caplog):
    rng = np.random.default_rng(4)
    ref = windows(random_corpus(tmp_path / "c", rng, files=1, rows=400), 15)
    ds = TokenDataset.open(DataSection(path=str(tmp_path / "c"), seq_len=15, read_ahead_mb=0.001))
    with caplog.at_level(logging.WARNING, logger="elastic_trainer.data.dataset"):
        for _ in range(2):
            x, _y = ds.sample(np.arange(len(ds)))
    assert (x == ref[:, :-1]).all()
    assert sum("more than data.read_ahead_mb" in r.message for r in caplog.records) == 1
    ds.prefetch(np.arange(len(ds)))  # never beyond the cap: reads at most what fits
    ds.close()
    assert ds.cached_bytes == 0


def test_concurrent_samples_and_prefetches_are_right(tmp_path):
    rng = np.random.default_rng(5)
    ref = windows(random_corpus(tmp_path / "c", rng, files=4, rows=300), 31)
    ds = TokenDataset.open(DataSection(path=str(tmp_path / "c"), seq_len=31, read_ahead_mb=0.004))
    errors = []

    def reader(seed):
        r = np.random.default_rng(seed)
        try:
            for _ in range(40):
                idx = r.integers(0, len(ds), 8)
                ds.prefetch(r.integers(0, len(ds), 8))
                x, y = ds.sample(idx)
                assert (x == ref[idx, :-1]).all() and (y == ref[idx, 1:]).all()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ds.close()
    assert not errors, errors
    assert not ds._pins and not ds._loading and ds._reserved == 0


def test_transient_read_error_is_retried_and_a_persistent_one_raises(tmp_path, monkeypatch):
    rng = np.random.default_rng(6)
    ref = windows(random_corpus(tmp_path / "c", rng, files=2), 9)
    read, calls = dataset_mod.read_row_group, []

    def flaky(*a):
        calls.append(a)
        if len(calls) == 1:
            raise OSError("connection reset")
        return read(*a)

    monkeypatch.setattr(dataset_mod, "read_row_group", flaky)
    ds = TokenDataset.open(DataSection(path=str(tmp_path / "c"), seq_len=9), retries=2)
    x, _ = ds.sample([3, 70])
    assert (x == ref[[3, 70], :-1]).all() and len(calls) >= 2

    def down(*a):
        raise OSError("connection reset")

    monkeypatch.setattr(dataset_mod, "read_row_group", down)
    ds = TokenDataset.open(DataSection(path=str(tmp_path / "c"), seq_len=9), retries=2)
    with pytest.raises(StorageError, match=r"reading row group \d+ of .*part-000.parquet failed after 3 attempts"):
        ds.sample([0])


def test_empty_rows_are_a_clear_error(tmp_path):
    rows = [[1, 2, 3], [], [4, 5, 6, 7]]
    write_rows(tmp_path / "s.parquet", rows, 10)
    with pytest.raises(DataError, match=r"s.parquet row group 0 holds 1 empty or null rows.*drop empty.*prepare-data"):
        TokenDataset.open(DataSection(path=str(tmp_path / "s.parquet"), seq_len=3))
    # Without statistics only the read can tell: the metadata counts 8 values, the rows hold 7 tokens.
    write_rows(tmp_path / "n.parquet", rows, 10, write_statistics=False)
    ds = TokenDataset.open(DataSection(path=str(tmp_path / "n.parquet"), seq_len=3))
    with pytest.raises(DataError, match=r"n.parquet row group 0: its metadata counts 8 token values but its "
                                        r"rows hold 7 tokens.*drop empty"):
        ds.sample([0])


def test_open_errors_name_what_was_given(tmp_path):
    write_rows(tmp_path / "f.parquet", [[0.5, 1.5]], 10, type_=pa.list_(pa.float32()))
    with pytest.raises(DataError, match=r"data.column\('tokens'\) in .* holds float, not integer token ids"):
        TokenDataset.open(DataSection(path=str(tmp_path / "f.parquet")))
    write_rows(tmp_path / "l.parquet", [[[1, 2]]], 10, type_=pa.list_(pa.list_(pa.int32())))
    with pytest.raises(DataError, match=r"holds list<element: int32>, not integer token ids"):
        TokenDataset.open(DataSection(path=str(tmp_path / "l.parquet")))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_SUCCESS").write_text("")
    with pytest.raises(DataError, match=r"data.path\('.*empty'\) is a directory with no Parquet files"):
        TokenDataset.open(DataSection(path=str(tmp_path / "empty")))
    write_rows(tmp_path / "t.parquet", [[1, 2, 3]], 10)
    with pytest.raises(DataError, match=r"holds 3 tokens in 1 rows, fewer than one window of seq_len\(3\) \+ 1 = 4"):
        TokenDataset.open(DataSection(path=str(tmp_path / "t.parquet"), seq_len=3))
    ds = TokenDataset.open(DataSection(path=str(tmp_path / "t.parquet"), seq_len=2))
    with pytest.raises(IndexError, match="window index 1 is out of range for 1 windows"):
        ds.sample([1])
    ds.close()
    with pytest.raises(ValueError, match="is closed"):
        ds.sample([0])
    ds.close()


def test_window_range_and_split(tmp_path):
    rng = np.random.default_rng(7)
    ref = windows(random_corpus(tmp_path / "c", rng), 11)
    n = len(ref)
    train_r, eval_r = split_windows(n, 0.1)
    assert eval_r == (n - int(np.ceil(n * 0.1)), n) and train_r == (0, eval_r[0])
    cfg = DataSection(path=str(tmp_path / "c"), seq_len=11)
    ev = TokenDataset.open(cfg, window_range=eval_r)
    tr = TokenDataset.open(cfg, window_range=train_r)
    assert len(ev) + len(tr) == n
    assert (ev.sample([0, len(ev) - 1])[0] == ref[[eval_r[0], n - 1], :-1]).all()
    assert (tr.sample(np.arange(len(tr)))[1] == ref[: len(tr), 1:]).all()
    with pytest.raises(IndexError):
        ev.sample([len(ev)])
    assert split_windows(30, 0.1) == ((0, 27), (27, 30))
    for bad in ((0, 0.001), (1, 0.5), (10, 0.99)):
        with pytest.raises(DataError, match="both need at least one"):
            split_windows(*bad)
    with pytest.raises(DataError, match=rf"window_range\(5, {n + 1}\) does not fit the {n} windows"):
        TokenDataset.open(cfg, window_range=(5, n + 1))


def test_windows_fingerprint(tmp_path):
    write_token_parquet(np.arange(2000) % 256, tmp_path / "f", row_len=10)
    ds = TokenDataset.open(DataSection(path=str(tmp_path / "f"), seq_len=9))
    a = ds.windows_fingerprint(np.array([3, 1, 4, 1, 5]))
    assert a == ds.windows_fingerprint([3, 1, 4, 1, 5]) and 0 <= a < 2**63
    assert a != ds.windows_fingerprint([3, 1, 4, 1, 6])
    assert a != ds.windows_fingerprint([1, 3, 4, 1, 5])  # order matters: inputs must meet their targets
    assert a != ds.windows_fingerprint([3, 1, 4, 1])
    assert len({ds.windows_fingerprint([i]) for i in range(len(ds))}) == len(ds)
    shifted = TokenDataset.open(DataSection(path=str(tmp_path / "f"), seq_len=9), window_range=(1, 200))
    assert shifted.windows_fingerprint([0]) == ds.windows_fingerprint([1])


# -- the sampler ----------------------------------------------------------------
@pytest.mark.parametrize("n", [1000, 37, 64 * 16 * 3 + 5, 128])
def test_every_epoch_is_a_permutation(n):
    s = GlobalSampler(n, seed=0, block=8, mix=4)
    for epoch in range(3):
        assert sorted(s.rows(epoch * n, n)) == list(range(n))
    # Any cut of the stream gives the same order: a pure function of (seed, g).
    assert (np.concatenate([s.rows(g, 7) for g in range(0, 3 * n, 7)])[: 3 * n] == s.rows(0, 3 * n)).all()
    assert len(s._blocks) <= 2 and len(s._mixes) <= 8


def test_shuffle_is_deterministic_by_seed():
    a, b, c = (GlobalSampler(5000, seed=s) for s in (1, 1, 2))
    assert (a.rows(123, 4000) == b.rows(123, 4000)).all()
    assert not (a.rows(0, 5000) == c.rows(0, 5000)).all()
    assert not (a.rows(0, 5000) == a.rows(5000, 5000)).all()  # each epoch its own order
    assert (GlobalSampler(50, seed=1, shuffle=False).rows(45, 10) == [45, 46, 47, 48, 49, 0, 1, 2, 3, 4]).all()


def test_a_global_batch_touches_few_blocks():
    n, block, mix, gb = 64 * 8 * 5 + 100, 64, 8, 16
    s = GlobalSampler(n, seed=3, block=block, mix=mix)
    touched = [len(np.unique(s.rows(step * gb, gb) // block)) for step in range(n // gb)]
    assert max(touched) <= mix + 1
    assert np.mean(touched) > 4  # still mixed: not one block per batch
    # A full permutation would touch nearly one block per sample.
    full = GlobalSampler(n, seed=3, block=1, mix=n)
    assert np.mean([len(np.unique(full.rows(st * gb, gb) // block)) for st in range(n // gb)]) > 12


def test_replica_slices_tile_the_global_batch():
    s = GlobalSampler(1000, seed=0, block=16, mix=4)
    whole = s.rows(64, 32)
    for dp in (1, 2, 4, 8):
        assert (np.concatenate([s.replica_rows(64, 32, dp, r) for r in range(dp)]) == whole).all()
    with pytest.raises(ValueError, match=r"block\(0\) and mix\(4\)"):
        GlobalSampler(10, 0, block=0, mix=4)
