import numpy as np
import pytest
import torch

from elastic_trainer.checkpoint.durable import CheckpointError, DurableStore
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
    # --resume (no run yet) takes the newest written, whichever run wrote it.
    assert DurableStore(str(tmp_path)).load_latest(own=False)[1]["run_id"] == "new"


def test_a_listing_error_is_an_error_not_an_empty_storage(tmp_path):
    from elastic_trainer.retry import StorageError

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
