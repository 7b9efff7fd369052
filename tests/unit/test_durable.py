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
    store = DurableStore(str(tmp_path))
    for s in (1, 2, 3, 4):
        store.save(s, [shard(s, [0], float(s))], {})
    store.prune(2)
    assert store.steps() == [4, 3]


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
