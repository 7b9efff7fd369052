"""At a restore a rank keeps the blocks it held and builds only those it gains, without initialising them."""

import torch
from torch import nn

from elastic_trainer.config import ModelSection
from elastic_trainer.models import build_model
from elastic_trainer.worker.block_build import build_rank_blocks

GPT = ModelSection(kind="gpt", n_layer=4, n_head=2, d_model=16, seq_len=8)
CPU = torch.device("cpu")


def test_the_start_builds_from_the_seed_like_a_single_process():
    blocks, _, info = build_rank_blocks(GPT, 3, [1, 2], CPU, restoring=False)
    ref, _ = build_model(GPT, 3)
    assert info == {"reused": [], "built": [1, 2], "init": "seed", "ties": [], "files": []}
    for i in (1, 2):
        for a, b in zip(blocks[i].parameters(), ref[i].parameters()):
            assert torch.equal(a, b)


def test_a_restore_reuses_held_blocks_and_builds_the_others_uninitialised(monkeypatch):
    held = {1: build_model(GPT, 0)[0][1]}
    inits = []
    monkeypatch.setattr(nn.init, "normal_", lambda t, *a, **k: inits.append(t.device.type) or t)
    blocks, _, info = build_rank_blocks(GPT, 0, [1, 2, 3], CPU, restoring=True, held=held)
    assert info == {"reused": [1], "built": [2, 3], "init": "empty", "ties": []}
    assert blocks[1] is held[1]
    assert all(p.device.type == "cpu" for i in (2, 3) for p in blocks[i].parameters())
    assert set(inits) == {"meta"}  # initialisers ran on shapes only, never on real memory


class _WithMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)


def _factory_with_buffers():
    return [nn.Linear(4, 4), _WithMask()], nn.MSELoss()


def _factory_needing_data():
    w = torch.ones(4, 4)
    if w.device.type == "meta":
        raise RuntimeError("cannot read a meta tensor")
    return [nn.Linear(4, 4)], nn.MSELoss()


def test_blocks_with_buffers_or_factories_that_need_data_are_built_for_real(monkeypatch):
    import sys
    import types

    mod = types.ModuleType("_build_probe")
    mod.with_buffers, mod.needs_data = _factory_with_buffers, _factory_needing_data
    monkeypatch.setitem(sys.modules, "_build_probe", mod)
    blocks, _, info = build_rank_blocks(ModelSection(factory="_build_probe:with_buffers"), 0, [1], CPU, True)
    assert info["init"] == "whole" and torch.equal(blocks[1].mask, torch.tril(torch.ones(4, 4)))
    # A block without buffers is still built empty beside it.
    assert build_rank_blocks(ModelSection(factory="_build_probe:with_buffers"), 0, [0], CPU, True)[2]["init"] == "empty"
    assert build_rank_blocks(ModelSection(factory="_build_probe:needs_data"), 0, [0], CPU, True)[2]["init"] == "whole"
