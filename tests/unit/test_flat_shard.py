"""Snapshots copied into reused flat buffers: same contents as a plain shard, one
pickled buffer per block, and a buffer is never overwritten while anything views it."""

import gc
import pickle

import numpy as np
import pytest
import torch

from elastic_trainer.checkpoint.flat import FlatShard, ShardExporter
from elastic_trainer.checkpoint.state import block_of, export_shard, load_into, merge_shards, select_blocks


def model(seed=0):
    torch.manual_seed(seed)
    blocks = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3), torch.nn.Linear(3, 2))
    named = [(f"blocks.{n}", p) for n, p in blocks.named_parameters()]
    opt = torch.optim.AdamW(blocks.parameters(), lr=0.1)
    blocks(torch.randn(4, 5)).square().sum().backward()
    opt.step()
    return blocks, named, opt


def pickled(obj):
    buffers = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return data, buffers


def test_flat_export_holds_what_a_plain_export_holds():
    _, named, opt = model()
    plain = export_shard(1, named, opt, [0, 1, 2])
    flat = ShardExporter().export(1, named, opt, [0, 1, 2], block_of)
    assert isinstance(flat, FlatShard)
    assert flat["params"].keys() == plain["params"].keys()
    for n in plain["params"]:
        assert np.array_equal(flat["params"][n], plain["params"][n])
        assert flat["optim"][n].keys() == plain["optim"][n].keys()
        for k, v in plain["optim"][n].items():
            assert np.array_equal(flat["optim"][n][k], v), (n, k)


def test_pickles_as_one_buffer_per_block_and_reads_back_into_a_model():
    _, named, opt = model()
    flat = ShardExporter().export(4, named, opt, [0, 1, 2], block_of)
    data, buffers = pickled(flat)
    assert len(buffers) == 3
    back = pickle.loads(data, buffers=buffers)
    assert isinstance(back, FlatShard) and back["step"] == 4
    m2, named2, opt2 = model(seed=1)
    step, params, optim = merge_shards([back], [n for n, _ in named2])
    load_into(named2, opt2, params, optim)
    for (_, a), (_, b) in zip(named, named2):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], opt2.state[b]["exp_avg_sq"])
        assert torch.equal(opt.state[a]["step"], opt2.state[b]["step"])


def test_a_selected_part_pickles_only_its_blocks():
    _, named, opt = model()
    flat = ShardExporter().export(2, named, opt, [0, 1, 2], block_of)
    part = select_blocks(flat, [2, 0])
    assert isinstance(part, FlatShard) and part["blocks"] == [0, 2]
    data, buffers = pickled(part)
    assert len(buffers) == 2
    back = pickle.loads(data, buffers=buffers)
    assert set(back["params"]) == {"blocks.0.weight", "blocks.0.bias", "blocks.2.weight", "blocks.2.bias"}
    assert np.array_equal(back["params"]["blocks.2.weight"], flat["params"]["blocks.2.weight"])


def test_a_buffer_is_reused_only_once_nothing_views_it():
    blocks, named, opt = model()
    ex = ShardExporter()
    kept = ex.export(1, named, opt, [0, 1, 2], block_of)
    before = kept["params"]["blocks.0.weight"].copy()
    assert ex.allocated == 3
    with torch.no_grad():
        blocks[0].weight.add_(1.0)
    second = ex.export(2, named, opt, [0, 1, 2], block_of)
    assert ex.allocated == 6, "the first copy is still referenced: its buffers must not be reused"
    assert np.array_equal(kept["params"]["blocks.0.weight"], before)
    # Only one array of the first copy survives: its block's buffer stays taken, the others free up.
    survivor = kept["params"]["blocks.1.bias"]
    del kept
    gc.collect()
    third = ex.export(3, named, opt, [0, 1, 2], block_of)
    assert ex.allocated == 7
    assert np.array_equal(third["params"]["blocks.0.weight"], second["params"]["blocks.0.weight"])
    assert survivor.shape == (3,)
    del second, third
    ex.export(4, named, opt, [0, 1, 2], block_of)
    assert ex.allocated == 7


def test_a_dtype_numpy_cannot_hold_is_named():
    # bfloat16 travels as its bits (test_dtypes_roundtrip); a float8 tensor has no way yet.
    weight = torch.nn.Parameter(torch.zeros(2, 2).to(torch.float8_e4m3fn), requires_grad=False)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(TypeError, match=r"blocks.0.weight: torch.float8_e4m3fn has no numpy equivalent"):
        ShardExporter().export(1, [("blocks.0.weight", weight)], opt, [0], block_of)
