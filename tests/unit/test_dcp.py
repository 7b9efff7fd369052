"""Durable checkpoints out as torch distributed checkpoints, and ``model.init_from`` one.

A checkpoint of a small GPT with one whole part and three slices of a sharded optimizer's
stage (thirds: cut mid-row) is exported; torch's own ``dcp.load`` and ``set_optimizer_state_dict``
read it back bit for bit, and a rank built from it reads only the files of its blocks."""

import itertools
import math
import os

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

from elastic_trainer.checkpoint.dcp_export import export_dcp, flat_boxes
from elastic_trainer.checkpoint.durable import DurableStore
from elastic_trainer.checkpoint.hf_export import ExportError
from elastic_trainer.checkpoint.state import block_of, export_shard
from elastic_trainer.cli.commands import main
from elastic_trainer.config import ModelSection, TrainerConfig
from elastic_trainer.errors import ModelError
from elastic_trainer.lr_schedule import lr_at
from elastic_trainer.models.build import build_model, build_own_blocks
from elastic_trainer.worker.stage import build_optimizer

MODEL = {"kind": "gpt", "n_layer": 2, "n_head": 2, "d_model": 8, "seq_len": 4, "vocab_size": 16}


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 5), ()])
def test_flat_boxes_tile_every_range(shape):
    n = math.prod(shape)
    flat = torch.arange(n).reshape(shape) if shape else torch.tensor(0)
    for s, e in itertools.combinations(range(n + 1), 2):
        seen = []
        for offsets, sizes, a, b in flat_boxes(shape, s, e):
            box = flat[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))]
            assert torch.equal(box.reshape(-1), torch.arange(a, b)), (shape, s, e, offsets, sizes)
            seen += range(a, b)
        assert sorted(seen) == list(range(s, e))
        assert len(flat_boxes(shape, s, e)) <= max(1, 2 * len(shape) - 1)


class Whole(nn.Module):
    """The single-process model: its state_dict() names parameters as the run does."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)


def _trained(cfg: TrainerConfig):
    blocks, loss_fn = build_model(cfg)
    model = Whole(blocks)
    opt = build_optimizer(list(model.named_parameters()), cfg.train)
    x = torch.randint(0, 16, (2, 4))
    loss_fn(nn.Sequential(*blocks)(x), x).backward()
    opt.step()
    return model, opt


def _cut(shard: dict, k: int, of: int) -> dict:
    """The ``k``-th of ``of`` slices of a whole part, as a sharded optimizer's rank holds it."""
    out = {**shard, "params": {}, "optim": {}, "ranges": {}}
    for name, a in shard["params"].items():
        n = a.size
        s, e = n * k // of, n * (k + 1) // of
        out["params"][name] = a.reshape(-1)[s:e].copy()
        out["optim"][name] = {key: (v if np.ndim(v) == 0 else v.reshape(-1)[s:e].copy())
                              for key, v in shard["optim"][name].items()}
        out["ranges"][name] = [s, e, list(a.shape)]
    return out


@pytest.fixture
def exported(tmp_path):
    cfg = TrainerConfig.from_dict({"model": MODEL, "data": {"path": "x", "seq_len": 4},
                                   "train": {"lr": 1e-2, "steps": 10}})
    model, opt = _trained(cfg)
    named = list(model.named_parameters())
    whole = export_shard(1, named, opt, list(range(4)))
    first = {k: v for k, v in whole.items()}
    first["params"] = {n: a for n, a in whole["params"].items() if block_of(n) < 2}
    first["optim"] = {n: st for n, st in whole["optim"].items() if block_of(n) < 2}
    first["blocks"] = [0, 1]
    rest = {**whole, "blocks": [2, 3], "params": {n: a for n, a in whole["params"].items() if block_of(n) >= 2},
            "optim": {n: st for n, st in whole["optim"].items() if block_of(n) >= 2}}
    store = DurableStore(str(tmp_path / "ck"), run_id="r1")
    src = store.save(1, [first, *(_cut(rest, k, 3) for k in range(3))], {"config": cfg.model_dump(mode="json")})
    out = str(tmp_path / "dcp")
    assert main(["export", "--format", "dcp", src, out]) == 0
    return cfg, model, opt, out


def _load_into_torch(cfg: TrainerConfig, out: str):
    """A fresh model and optimizer loaded from the DCP at ``out`` as a torchtitan user would: the model's
    state dict, then the ``optimizer`` part through ``set_optimizer_state_dict`` (flattened)."""
    fresh = Whole(build_model(cfg, seed=99)[0])
    state = {k: torch.zeros_like(v) for k, v in fresh.state_dict().items()}
    dcp.load(state, checkpoint_id=out)
    fresh.load_state_dict(state)
    fresh_opt = build_optimizer(list(fresh.named_parameters()), cfg.train)
    meta = dcp.FileSystemReader(out).read_metadata().state_dict_metadata
    keys = [k.removeprefix("optimizer.") for k in meta if k.startswith("optimizer.")]
    tensors = {k: torch.empty(meta["optimizer." + k].size, dtype=meta["optimizer." + k].properties.dtype)
               for k in keys if isinstance(meta["optimizer." + k], TensorStorageMetadata)}
    dcp.load({"optimizer": tensors}, checkpoint_id=out)
    objects = {f"optimizer.{k}": None for k in keys if k not in tensors}
    dcp.load(objects, checkpoint_id=out)   # param_groups: small pickles (lr, betas, ...)
    flat = {**tensors, **{k.removeprefix("optimizer."): v for k, v in objects.items()}}
    set_optimizer_state_dict(fresh, fresh_opt, flat, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return fresh, fresh_opt


def _same_optimizer_state(model, opt, fresh, fresh_opt):
    by_name = dict(model.named_parameters())
    for name, p in fresh.named_parameters():
        want, got = opt.state[by_name[name]], fresh_opt.state[p]
        assert set(got) == set(want), name
        for key in want:
            assert torch.equal(got[key], want[key]), (name, key)


def test_a_durable_checkpoint_loads_with_torch_dcp(exported):
    cfg, model, opt, out = exported
    assert sorted(f for f in os.listdir(out) if f.endswith(".distcp")) == [f"__{k}_0.distcp" for k in range(4)]
    fresh, fresh_opt = _load_into_torch(cfg, out)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    _same_optimizer_state(model, opt, fresh, fresh_opt)
    assert set(fresh_opt.state[fresh.blocks[0].tok.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    assert fresh_opt.param_groups[0]["lr"] == lr_at(cfg.train, 2)


def test_another_optimizer_and_its_param_groups(tmp_path):
    """Adafactor (factored second moments, of shapes other than the parameter's) and a group of
    its own for the biases at a tenth of the rate: what loads is the run's, group by group."""
    cfg = TrainerConfig.from_dict({"model": MODEL, "data": {"path": "x", "seq_len": 4}, "train": {
        "lr": 1e-2, "steps": 10, "lr_schedule": "linear", "optimizer": {
            "name": "Adafactor", "kwargs": {"weight_decay": 0.05}, "param_groups": [{"match": "*.bias", "lr": 1e-3, "weight_decay": 0.0}]}}})
    model, opt = _trained(cfg)
    whole = export_shard(1, list(model.named_parameters()), opt, list(range(4)))
    src = DurableStore(str(tmp_path / "ck"), run_id="r2").save(1, [whole], {"config": cfg.model_dump(mode="json")})
    out = export_dcp(src, str(tmp_path / "dcp"))
    fresh, fresh_opt = _load_into_torch(cfg, out)
    _same_optimizer_state(model, opt, fresh, fresh_opt)
    assert {k for st in fresh_opt.state.values() for k in st} >= {"row_var", "col_var"}
    rate = lr_at(cfg.train, 2)
    by_lr = sorted(fresh_opt.param_groups, key=lambda g: g["lr"])
    assert [g["lr"] for g in by_lr] == pytest.approx([rate / 10, rate])
    names = {id(p): n for n, p in fresh.named_parameters()}
    assert {names[id(p)].endswith(".bias") for p in by_lr[0]["params"]} == {True}
    assert by_lr[0]["weight_decay"] == 0.0 and by_lr[1]["weight_decay"] == 0.05


def test_init_from_a_dcp_reads_only_the_ranks_files(exported):
    cfg, model, _, out = exported
    section = ModelSection.model_validate({**MODEL, "init_from": out})
    blocks, _, _, how = build_own_blocks(section, 5, [2, 3])
    assert how["how"] == "load" and how["files"] == ["__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    state = model.state_dict()
    for i, b in blocks.items():
        for local, p in b.named_parameters():
            assert torch.equal(p, state[f"blocks.{i}.{local}"])
    assert build_own_blocks(section, 5, [0])[3]["files"] == ["__0_0.distcp"]


def test_a_dcp_that_does_not_fit_is_named(exported, tmp_path):
    _, _, _, out = exported
    wider = ModelSection.model_validate({**MODEL, "d_model": 16, "init_from": out})
    with pytest.raises(ModelError, match=r"'blocks.1.ln1.weight' has shape \(8,\) in the checkpoint; block 1's "
                                         r"parameter 'ln1.weight' needs \(16,\)"):
        build_own_blocks(wider, 0, [1])
    deeper = ModelSection.model_validate({**MODEL, "n_layer": 3, "init_from": out})
    with pytest.raises(ModelError, match=r"no tensor 'blocks.3.ln1.weight'"):
        build_own_blocks(deeper, 0, [3])
    with pytest.raises(ModelError, match=r"no \.metadata there"):
        build_own_blocks(ModelSection.model_validate({**MODEL, "init_from": str(tmp_path)}), 0, [0])


def test_export_arguments(tmp_path, capsys):
    assert main(["export", str(tmp_path / "none"), str(tmp_path / "o"), "--format", "dcp"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "none")]) == 2
    assert "give the folder to write" in capsys.readouterr().err
    assert main(["export", "x", "--hf", "a", "--format", "dcp"]) == 2
    assert "--hf OUT writes a Hugging Face folder" in capsys.readouterr().err
    with pytest.raises(ExportError, match="writes a local folder"):
        export_dcp(str(tmp_path), "s3://bucket/out")


GPT2 = {"kind": "hf", "hf_config": {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4,
                                    "n_positions": 32}}


@pytest.mark.parametrize("model", [GPT2, {"factory": "tests.helpers:build_mlp", "kwargs": {"width": 8}},
                                   {"factory": "tests.helpers:build_mlp_parts", "kwargs": {"width": 8}}],
                         ids=["hf-gpt2-tied", "factory-whole", "factory-parts"])
def test_init_from_a_dcp_saved_by_torch_for_any_kind(model, tmp_path):
    """A DCP that torch's own ``dcp.save`` wrote from the single-process model (as torchtitan would),
    a tied head saved once under its leader's name: each kind's ranks start from it."""
    from elastic_trainer.models.hf import block_ties

    section = ModelSection.model_validate(model)
    blocks, _ = build_model(section, seed=1)
    state = {f"blocks.{i}.{n}": p.detach().clone() for i, b in enumerate(blocks) for n, p in b.named_parameters()}
    followers = {f for _, f in block_ties(blocks)}
    assert followers or model is not GPT2
    dcp.save({k: v for k, v in state.items() if k not in followers}, checkpoint_id=str(tmp_path / "dcp"))
    loaded = ModelSection.model_validate({**model, "init_from": str(tmp_path / "dcp")})
    last = len(blocks) - 1
    own, _, _, how = build_own_blocks(loaded, 2, [1, last])
    assert how["files"] == ["__0_0.distcp"]
    other = build_own_blocks(section, 2, [1])[0][1]
    assert not all(torch.equal(a, b) for a, b in zip(other.parameters(), own[1].parameters()))
    for i, b in own.items():
        for n, p in b.named_parameters():
            assert torch.equal(p, state[f"blocks.{i}.{n}"]), (i, n)


def test_a_runs_weights_export_as_the_model_alone(tmp_path):
    from elastic_trainer.checkpoint.weights import save_weights

    blocks, _ = build_model(ModelSection.model_validate(MODEL), seed=3)
    state = {f"blocks.{k}": v for k, v in Whole(blocks).blocks.state_dict().items()}
    src = save_weights(str(tmp_path / "w"), state, {"model": MODEL})
    out = export_dcp(src, str(tmp_path / "dcp"))
    assert set(dcp.FileSystemReader(out).read_metadata().state_dict_metadata) == set(state)
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(got, checkpoint_id=out)
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_a_second_export_replaces_the_first(exported, tmp_path):
    cfg, model, _, out = exported
    blocks, _ = build_model(cfg, seed=4)
    state = {f"blocks.{k}": v for k, v in Whole(blocks).blocks.state_dict().items()}
    from elastic_trainer.checkpoint.weights import save_weights

    export_dcp(save_weights(str(tmp_path / "w"), state, {"model": MODEL}), out)
    assert set(dcp.FileSystemReader(out).read_metadata().state_dict_metadata) == set(state)
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(got, checkpoint_id=out)
    assert all(torch.equal(got[k], v) for k, v in state.items())
