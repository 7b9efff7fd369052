import threading

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from elastic_trainer.checkpoint.durable import CheckpointError, DurableStore
from elastic_trainer.storage.retry import StorageError
from elastic_trainer.checkpoint.resume_lookup import load_resume, runs
from elastic_trainer.checkpoint.state import export_shard, load_into, merge_shards


def shard(step, blocks, value):
    return {"step": step, "blocks": blocks, "extra": {},
            "params": {f"blocks.{b}.w": np.full((2, 3), value + b, np.float32) for b in blocks},
            "optim": {f"blocks.{b}.w": {"exp_avg": np.ones((2, 3), np.float32), "step": np.asarray(step, np.float32)}
                      for b in blocks}}


def test_round_trip_and_fallback_from_corrupt(tmp_path):
    store = DurableStore(str(tmp_path / "ck"))
    store.save(2, [shard(2, [0, 1], 2.0), shard(2, [2], 2.0)], {"history": [{"step": 1}]})
    store.save(4, [shard(4, [0, 1, 2], 4.0)], {})
    shards, manifest, problems = store.load_latest()
    assert manifest["step"] == 4 and problems == []
    assert shards[0]["params"]["blocks.2.w"][0, 0] == 6.0

    # Flip bytes in the newest: reported, and the previous one is used.
    f = tmp_path / "ck" / "step-00000004" / "shard-000.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    shards, manifest, problems = store.load_latest()
    assert manifest["step"] == 2 and manifest["history"] == [{"step": 1}]
    assert len(problems) == 1 and "corrupt" in problems[0]
    assert {b for s in shards for b in s["blocks"]} == {0, 1, 2}


def test_half_written_checkpoint_is_skipped(tmp_path):
    store = DurableStore(str(tmp_path))
    store.save(1, [shard(1, [0], 1.0)], {})
    (tmp_path / "step-00000009").mkdir()
    (tmp_path / "step-00000009" / "shard-000.pt").write_bytes(b"partial")
    _, manifest, problems = store.load_latest()
    assert manifest["step"] == 1 and "not finished" in problems[0]


def test_nothing_usable_is_an_error(tmp_path):
    (tmp_path / "step-00000003").mkdir()
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        DurableStore(str(tmp_path)).load_latest()
    assert DurableStore(str(tmp_path / "empty")).load_latest() is None


def test_pickled_code_is_refused(tmp_path):
    store = DurableStore(str(tmp_path))
    store.save(1, [shard(1, [0], 1.0)], {})
    f = tmp_path / "step-00000001" / "shard-000.pt"
    import hashlib, json, os

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"params": Evil(), "optim": {}}, f)
    m = tmp_path / "step-00000001" / "manifest.json"
    man = json.loads(m.read_text())
    man["files"][0]["sha256"] = hashlib.sha256(f.read_bytes()).hexdigest()
    m.write_text(json.dumps(man))
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        store.load(1)


def test_prune_keeps_newest(tmp_path):
    store = DurableStore(str(tmp_path), run_id="a1")
    for s in (1, 2, 3, 4):
        store.save(s, [shard(s, [0], float(s))], {})
    store.prune(2)
    assert store.steps() == [4, 3]


def test_prune_leaves_another_runs_checkpoints_alone(tmp_path):
    # An older run got further (steps 50, 60) in the same storage; a new run prunes only its own.
    old = DurableStore(str(tmp_path), run_id="old")
    for s in (50, 60):
        old.save(s, [shard(s, [0], float(s))], {})
    (tmp_path / "step-00000070").mkdir()   # a checkpoint of no run (older layout)
    new = DurableStore(str(tmp_path), run_id="new")
    for s in (10, 20, 30):
        new.save(s, [shard(s, [0], float(s))], {})
        new.prune(2)
    assert new.steps() == [30, 20]
    assert old.steps() == [60, 50] and (tmp_path / "step-00000070").is_dir()
    # Its own newest is what it restores, not the other run's later steps.
    assert new.load_latest()[1]["step"] == 30 and new.load_latest()[1]["run_id"] == "new"
    # A look at the whole storage (own=False) finds the newest written, whichever run wrote it.
    assert DurableStore(str(tmp_path)).load_latest(own=False)[1]["run_id"] == "new"


def test_a_listing_error_is_an_error_not_an_empty_storage(tmp_path):
    from elastic_trainer.storage.retry import StorageError

    store = DurableStore(str(tmp_path), run_id="r", retries=1, backoff_s=0.01)
    calls = []

    class Flaky:
        def __getattr__(self, name):
            return getattr(store_fs, name)

        def get_file_info(self, *a):
            calls.append(1)
            raise OSError("When listing objects under key 'ck': AWS Error NETWORK_CONNECTION")

    store_fs, store.fs = store.fs, Flaky()
    with pytest.raises(StorageError, match="listing checkpoints.*2 attempts.*NETWORK_CONNECTION"):
        store.load_latest()
    assert len(calls) == 2
    # A missing root is an empty storage, though.
    assert DurableStore(str(tmp_path / "none"), run_id="r").load_latest() is None


def test_a_transient_write_error_is_retried(tmp_path):
    store = DurableStore(str(tmp_path), run_id="r", retries=2, backoff_s=0.01)
    real = store.fs
    failures = [1]

    class Flaky:
        def __getattr__(self, name):
            return getattr(real, name)

        def open_output_stream(self, path, *a, **k):
            if failures:
                failures.pop()
                raise OSError("AWS Error SLOW_DOWN during PutObject operation: Please reduce your request rate.")
            return real.open_output_stream(path, *a, **k)

    store.fs = Flaky()
    store.save(5, [shard(5, [0, 1], 5.0)], {})
    assert not failures and store.load(5)[1]["step"] == 5


def test_a_write_that_fails_midway_leaves_no_part_and_is_retried_on_the_storage_error(tmp_path):
    store = DurableStore(str(tmp_path), run_id="r", retries=2, backoff_s=0.01)
    real = store.fs
    failures, seen = [1], []

    class Breaks:
        """An output stream whose storage fails after the part's first bytes."""

        def __init__(self, inner):
            self.inner, self.written = inner, 0

        def write(self, b):
            if failures and self.written:
                failures.pop()
                raise OSError("connection reset while uploading a part")
            self.written += len(b)
            return self.inner.write(b)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.inner.close()
            seen.append(real.get_file_info(self.path).size)

    class Flaky:
        def __getattr__(self, name):
            return getattr(real, name)

        def open_output_stream(self, path, *a, **k):
            out = Breaks(real.open_output_stream(path, *a, **k))
            out.path = path
            return out

    store.fs = Flaky()
    store.save(5, [shard(5, [0, 1], 5.0)], {})
    # The first try stopped midway (torch's writer then raised over it): retried as the storage's
    # error, and the whole part is what loads.
    assert not failures and seen[0] < seen[1]   # then the manifest
    assert store.load(5)[1]["step"] == 5
    # Failing every time: the error names the storage's, and no truncated part is left behind.
    failures.extend([1] * 3)
    with pytest.raises(StorageError, match="connection reset while uploading a part"):
        store.write_part(6, 0, shard(6, [0, 1], 6.0))
    assert real.get_file_info(f"{store.step_dir(6)}/shard-000.pt").type == pafs.FileType.NotFound


def test_shard_state_round_trips_through_adamw():
    lin = torch.nn.Linear(3, 2)
    named = [("blocks.0.weight", lin.weight), ("blocks.0.bias", lin.bias)]
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    lin(torch.ones(1, 3)).sum().backward()
    opt.step()
    sh = export_shard(1, named, opt, [0])
    lin2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.AdamW(lin2.parameters(), lr=0.1)
    named2 = [("blocks.0.weight", lin2.weight), ("blocks.0.bias", lin2.bias)]
    step, params, optim = merge_shards([sh], [n for n, _ in named2])
    load_into(named2, opt2, params, optim)
    assert step == 1 and torch.equal(lin.weight, lin2.weight)
    for o in (opt, opt2):
        o.zero_grad()
    for m, o in ((lin, opt), (lin2, opt2)):
        m(torch.ones(1, 3)).sum().backward()
        o.step()
    assert torch.equal(lin.weight, lin2.weight)


def test_mixing_steps_is_refused():
    with pytest.raises(ValueError, match="refusing to mix states from steps"):
        merge_shards([shard(1, [0], 1.0), shard(2, [1], 1.0)], ["blocks.0.w", "blocks.1.w"])


# -- a prune while a recovery reads -------------------------------------------------------------

class _PausedRead:
    """The real local filesystem, but the first read of a shard waits for ``go`` (after saying
    so on ``reading``): a recovery stopped between its manifest and its shards."""

    def __init__(self, real):
        self.real, self.reading, self.go = real, threading.Event(), threading.Event()
        self.armed = True

    def __getattr__(self, name):
        return getattr(self.real, name)

    def open_input_stream(self, path, *a, **k):
        if self.armed and "/shard-" in path:
            self.armed = False
            self.reading.set()
            assert self.go.wait(60), "the test never let the read go on"
        return self.real.open_input_stream(path, *a, **k)


def _read_in_thread(store):
    out = {}

    def read():
        try:
            out["loaded"] = store.load_latest()
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            out["error"] = e

    t = threading.Thread(target=read)
    t.start()
    return t, out


def test_a_prune_never_deletes_the_checkpoint_a_recovery_is_reading(tmp_path):
    # One store, as the controller has: the durable writer's thread writes and prunes while a
    # recovery (restore_points.load_durable) reads the newest checkpoint.
    store = DurableStore(str(tmp_path), run_id="r")
    for s in (1, 2):
        store.save(s, [shard(s, [0, 1], float(s))], {})
    store.prune(1)
    store.fs = paused = _PausedRead(store.fs)
    reader, out = _read_in_thread(store)
    assert paused.reading.wait(60)
    store.save(3, [shard(3, [0, 1], 3.0)], {})
    store.prune(1)                       # the writer, while step 2's shards are open
    paused.go.set()
    reader.join()
    assert "error" not in out, out.get("error")
    shards, manifest, problems = out["loaded"]
    assert manifest["step"] == 2 and problems == [] and shards[0]["params"]["blocks.1.w"][0, 0] == 3.0
    assert store.steps() == [3, 2]       # kept while read, let go by the next prune
    store.prune(1)
    assert store.steps() == [3]


def test_a_reader_whose_checkpoint_another_store_prunes_reads_the_newer_one(tmp_path):
    # Another store of the same run (another process) finishes step 3, which the reader saw
    # half-written, and prunes the checkpoint being read: the reader lists again and loads
    # step 3, not "no usable checkpoint".
    reader, writer = DurableStore(str(tmp_path), run_id="r"), DurableStore(str(tmp_path), run_id="r")
    writer.save(2, [shard(2, [0], 2.0)], {})
    (tmp_path / "step-00000003-r").mkdir()
    (tmp_path / "step-00000003-r" / "shard-000.pt").write_bytes(b"half")
    reader.fs = paused = _PausedRead(reader.fs)
    thread, out = _read_in_thread(reader)
    assert paused.reading.wait(60)
    writer.save(3, [shard(3, [0], 3.0)], {})
    writer.prune(1)
    assert writer.steps() == [3]
    paused.go.set()
    thread.join()
    assert "error" not in out, out.get("error")
    _, manifest, problems = out["loaded"]
    assert manifest["step"] == 3 and problems == []


def test_a_prune_keeps_the_newest_complete_checkpoint(tmp_path):
    store = DurableStore(str(tmp_path), run_id="r")
    store.save(1, [shard(1, [0], 1.0)], {})
    (tmp_path / "step-00000002-r").mkdir()          # a write that died half-way
    (tmp_path / "step-00000002-r" / "shard-000.pt").write_bytes(b"partial")
    store.prune(1)
    assert store.steps() == [2, 1] and store.load_latest()[1]["step"] == 1
    with pytest.raises(ValueError, match=r"keep 0: a prune keeps at least the newest complete checkpoint"):
        store.prune(0)


# -- which checkpoints --resume reads ----------------------------------------------------------

def _two_runs(root):
    """Run "alpha" (id a1, steps 2 and 4) and, written after it, run "beta" (id b2, steps 6 and 8)."""
    for run_id, name, steps in (("a1", "alpha", (2, 4)), ("b2", "beta", (6, 8))):
        store = DurableStore(str(root), run_id=run_id)
        for s in steps:
            store.save(s, [shard(s, [0, 1], float(s))], {"run_name": name, "history": [{"step": s}]})
    return DurableStore(str(root))


def _spoil(root, run_id):
    """Every shard of ``run_id`` overwritten: a resume that reads one of them reports it corrupt."""
    for f in root.glob(f"step-*-{run_id}/shard-*.pt"):
        f.write_bytes(b"not this run's")


def test_resume_by_name_reads_that_run_only(tmp_path):
    store = _two_runs(tmp_path)
    _spoil(tmp_path, "b2")
    got = load_resume(store, "alpha")
    assert (got.manifest["step"], got.run_id, got.newest, got.problems) == (4, "a1", True, [])
    assert runs(store)["b2"]["name"] == "beta" and runs(store)["a1"]["steps"] == [4, 2]
    assert load_resume(store, "gamma") is None          # no run of that name: a fresh start
    by_id = load_resume(store, "alpha", "a1")
    assert (by_id.manifest["step"], by_id.run_id, by_id.newest) == (4, "a1", True)


def test_resume_names_what_it_cannot_find_and_refuses_an_ambiguous_name(tmp_path):
    store = _two_runs(tmp_path)
    with pytest.raises(CheckpointError, match=r"no run 'zz9' in .*runs there: a1 \(alpha, newest step 4\), "
                                              r"b2 \(beta, newest step 8\)"):
        load_resume(store, "alpha", "zz9")
    DurableStore(str(tmp_path), run_id="c3").save(1, [shard(1, [0, 1], 1.0)], {"run_name": "alpha"})
    with pytest.raises(CheckpointError, match=r"2 runs named 'alpha' .*a1 \(newest step 4\).*c3 \(newest step 1\)"
                                              r".*resume one by its id"):
        load_resume(store, "alpha")


def test_resume_from_a_checkpoint_path(tmp_path):
    store = _two_runs(tmp_path)
    newest = load_resume(store, "x", str(tmp_path / "step-00000008-b2"))
    assert (newest.manifest["step"], newest.run_id, newest.newest) == (8, "b2", True)
    # An older one of its run: continuing as that run would prune its own new checkpoints
    # behind the old run's later ones, so it is a branch (newest False).
    older = load_resume(store, "x", "step-00000006-b2")
    assert (older.manifest["step"], older.run_id, older.newest) == (6, "b2", False)
    with pytest.raises(CheckpointError, match=r"not in checkpoint.storage"):
        load_resume(store, "x", str(tmp_path / "elsewhere" / "step-00000006-b2"))
    with pytest.raises(CheckpointError, match=r"no checkpoint step-00000005-b2 in"):
        load_resume(store, "x", "step-00000005-b2")
    _spoil(tmp_path, "b2")
    with pytest.raises(CheckpointError, match=r"step-00000008-b2: shard-000.pt is corrupt"):
        load_resume(store, "x", "step-00000008-b2")   # the one asked for, or none


def _slice(step, blocks, lo, hi):
    """One sharded rank's part: every block's weights whole, the moments of elements [lo, hi) only."""
    part = shard(step, blocks, 1.0)
    part["ranges"] = {n: [lo, hi, [2, 3]] for n in part["params"]}
    part["optim"] = {n: {"exp_avg": np.ones(hi - lo, np.float32), "step": np.asarray(step, np.float32)}
                     for n in part["params"]}
    return part


def test_a_sharded_checkpoint_missing_a_ranks_slice_is_refused_before_its_manifest(tmp_path):
    # Two ranks of one stage each hold half of the moments: one slice alone is not a checkpoint.
    store = DurableStore(str(tmp_path / "ck"), run_id="r1")
    whole = [store.write_part(5, 0, _slice(5, [0, 1], 0, 3)), store.write_part(5, 1, _slice(5, [0, 1], 3, 6))]
    assert whole[0]["spans"]["blocks.0.w"] == [0, 3, 6]
    store.commit(5, whole, {}, n_blocks=2)
    assert store.load(5)[1]["step"] == 5
    half = [store.write_part(6, 0, _slice(6, [0, 1], 0, 3))]
    with pytest.raises(CheckpointError, match=r"3 of its 6 moments' elements.*slice is missing"):
        store.commit(6, half, {}, n_blocks=2)
    with pytest.raises(CheckpointError, match=r"block\(s\) \[2\] in no part"):
        store.commit(6, [store.write_part(6, 0, shard(6, [0, 1], 1.0))], {}, n_blocks=3)
    # No manifest was written: the newest checkpoint is still step 5's.
    assert store.load_latest()[1]["step"] == 5
