"""State of any dtype (bfloat16 included) through snapshots and durable checkpoints, bit for bit."""

import pickle

import pytest
import torch
from torch import nn

from elastic_trainer.checkpoint.durable import DurableStore
from elastic_trainer.checkpoint.flat import ShardExporter
from elastic_trainer.checkpoint.state import block_of, export_shard, load_into

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _trained(dtype, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)).to(dtype)
    # eps within float16's range: AdamW's default 1e-8 rounds to 0 there and the moments turn to NaN.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    for _ in range(2):
        model(torch.randn(3, 8, dtype=dtype)).float().pow(2).sum().backward()
        opt.step()
    named = [(f"blocks.{name}", p) for name, p in model.named_parameters()]
    return model, opt, named


def _bits(t):
    """The raw bytes: equal bits, not just equal values (-0.0 vs 0.0, NaN payloads)."""
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _assert_same(named_a, opt_a, named_b, opt_b):
    for (name, p), (_, q) in zip(named_a, named_b):
        assert p.dtype == q.dtype and _bits(p) == _bits(q), name
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for k, v in opt_a.state[p].items():
            w = opt_b.state[q][k]
            assert v.dtype == w.dtype and _bits(v) == _bits(w), (name, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("how", ["copy", "view", "flat"])
def test_a_snapshot_restores_bit_exactly(dtype, how):
    model, opt, named = _trained(dtype, 0)
    if how == "flat":
        shard = ShardExporter().export(2, named, opt, [0, 1], block_of)
    else:
        shard = export_shard(2, named, opt, [0, 1], copy=how == "copy")
    shard = pickle.loads(pickle.dumps(shard))  # as the object store hands it over
    fresh, fresh_opt, fresh_named = _trained(dtype, 1)
    load_into(fresh_named, fresh_opt, shard["params"], shard["optim"])
    _assert_same(named, opt, fresh_named, fresh_opt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_durable_checkpoint_restores_bit_exactly(dtype, tmp_path):
    model, opt, named = _trained(dtype, 0)
    store = DurableStore(str(tmp_path / "ck"))
    store.save(2, [ShardExporter().export(2, named, opt, [0, 1], block_of)], {"history": []})
    shards, manifest, problems = store.load_latest()
    assert manifest["step"] == 2 and not problems
    fresh, fresh_opt, fresh_named = _trained(dtype, 1)
    load_into(fresh_named, fresh_opt, shards[0]["params"], shards[0]["optim"])
    _assert_same(named, opt, fresh_named, fresh_opt)
