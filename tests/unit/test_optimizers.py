"""train.optimizer: its config checks, parameter groups by name, the learning-rate schedule across
groups, sliced (sharded) updates against whole ones, and any optimizer's state through a snapshot."""

import numpy as np
import pytest
import torch

from elastic_trainer.checkpoint.fingerprint import held_fingerprint, part_fingerprint, saved_fingerprint
from elastic_trainer.checkpoint.state import export_shard, load_into, merge_shards
from elastic_trainer.config import TrainerConfig
from elastic_trainer.errors import ConfigError
from elastic_trainer.lr_schedule import set_lr
from elastic_trainer.models.factory import model_param_names
from elastic_trainer.optim import build_optimizer, check_patterns, state_floats
from elastic_trainer.planning.layouts import Layout
from elastic_trainer.planning.memory import MemoryModel, layout_shard
from elastic_trainer.planning.model_shape import model_shape

from ..conftest import tiny_config

LION = "tests.optim_lion:Lion"


def cfg(parallel=None, **train):
    return TrainerConfig.from_dict(tiny_config("/nowhere", train=train, parallel=parallel or {}))


@pytest.mark.parametrize("train, words", [
    ({"optimizer": {"name": "Adamm"}}, ["('Adamm') is not a torch.optim optimizer", "AdamW", "Adafactor", "SGD",
                                        "package.module:Class"]),
    ({"optimizer": {"name": "tests.optim_lion:Lino"}}, ["'tests.optim_lion'", "no class 'Lino'"]),
    ({"optimizer": {"name": "no_such_pkg.mod.Cls"}}, ["cannot import 'no_such_pkg.mod'"]),
    ({"optimizer": {"name": "tests.helpers:build_mlp"}}, ["no class 'build_mlp'"]),
    ({"optimizer": {"name": "LBFGS"}}, ["LBFGS", "closure"]),
    ({"optimizer": {"name": "Muon"}}, ["Muon", "2-D parameters only"]),
    ({"optimizer": {"name": "SGD", "kwargs": {"momentum": 0.9, "betas": [0.9, 0.99]}}},
     ["SGD takes no 'betas'", "momentum", "nesterov"]),
    ({"optimizer": {"name": "SGD", "kwargs": {"lr": 0.1}}}, ["'lr'", "train.lr"]),
    ({"optimizer": {"name": "SGD", "kwargs": {"momentum": -1}}}, ["Invalid momentum value: -1"]),
    ({"optimizer": {"name": "SGD"}, "betas": [0.9, 0.95]}, ["train.betas", "SGD does not take"]),
    ({"optimizer": {"kwargs": {"weight_decay": 0.1}}, "weight_decay": 0.2}, ["train.weight_decay(0.2)", "set one"]),
    ({"optimizer": {"name": "SGD", "param_groups": [{"weight_decay": 0.0}]}}, ["param_groups[0]", "'match'", "'regex'"]),
    ({"optimizer": {"name": "SGD", "param_groups": [{"regex": "(", "weight_decay": 0.0}]}},
     ["param_groups[0].regex('(')", "not a regular expression"]),
    ({"optimizer": {"name": "SGD", "param_groups": [{"match": "*.bias", "betas": [0.9, 0.9]}]}},
     ["param_groups[0]", "SGD takes no 'betas'"]),
    ({"optimizer": {"name": LION, "kwargs": {"momentum": 0.9}}}, ["Lion takes no 'momentum'", "betas"]),
])
def test_a_bad_optimizer_section_is_a_config_error_naming_what_was_given_and_what_fits(train, words):
    with pytest.raises(ConfigError) as e:
        cfg(**train)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_sharding_is_refused_for_an_optimizer_that_is_not_elementwise_and_auto_does_not_shard_it():
    for shard in ("optimizer", "gradients"):
        with pytest.raises(ConfigError, match="Adafactor's is not"):
            cfg({"dp": 2, "shard_optimizer": shard}, optimizer={"name": "Adafactor"})
    # A user class is sharded only where it says it is elementwise (Lion does).
    assert cfg({"dp": 2, "shard_optimizer": "gradients"}, optimizer={"name": LION}).parallel.shard_optimizer == "gradients"
    with pytest.raises(ConfigError, match="does not declare elementwise"):
        cfg({"dp": 2, "shard_optimizer": "optimizer"}, optimizer={"name": "tests.unit.test_optimizers:Plain"})
    # auto with a bound nothing fits: AdamW shards, Adafactor does not.
    lay, tiny_bound = Layout(2, 1, ((0, 8),), 4), 1.0
    adamw, ada = cfg({"dp": 2}), cfg({"dp": 2}, optimizer={"name": "Adafactor"})
    assert layout_shard(adamw, lay, model_shape(adamw), tiny_bound) == "gradients"
    assert layout_shard(ada, lay, model_shape(ada), tiny_bound) == "none"


class Plain(torch.optim.SGD):
    """A user optimizer that does not declare itself elementwise."""


def test_the_default_optimizer_is_adamw_as_before_and_the_old_fields_still_apply():
    model = torch.nn.Linear(3, 2)
    g = build_optimizer(model.parameters(), cfg().train).param_groups[0]
    ref = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=1e-3, weight_decay=0.01).param_groups[0]
    assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in ref.items() if k != "params"}
    old = build_optimizer(model.parameters(), cfg(weight_decay=0.1, betas=[0.8, 0.9], eps=1e-6).train).param_groups[0]
    assert (old["weight_decay"], old["betas"], old["eps"]) == (0.1, (0.8, 0.9), 1e-6)
    # weight decay 0.01 is AdamW's default only: Adam and SGD keep torch's 0 unless it is set.
    assert build_optimizer(model.parameters(), cfg(optimizer={"name": "Adam"}).train).param_groups[0]["weight_decay"] == 0
    sgd = cfg(weight_decay=0.1, optimizer={"name": "SGD", "kwargs": {"momentum": 0.9, "nesterov": True}}).train
    opt = build_optimizer(model.parameters(), sgd)
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["weight_decay"] == 0.1
    assert type(build_optimizer(model.parameters(), cfg(optimizer={"name": "torch.optim.Adamax"}).train)) is torch.optim.Adamax


def test_param_groups_by_name_and_the_schedule_keeps_each_groups_ratio():
    c = cfg(lr=1e-3, optimizer={"name": "AdamW", "param_groups": [
        {"match": "*.bias", "weight_decay": 0.0},
        {"regex": r"\.ln_?\w*\.weight$|norm", "weight_decay": 0.0, "lr": 5e-4}]})
    names = model_param_names(c.model)
    check_patterns(c.train.optimizer, names)
    # A rank holding only some blocks gets only the groups that apply to them.
    held = [(n, torch.nn.Parameter(torch.zeros(2))) for n in names if n.startswith("blocks.2.")]
    opt = build_optimizer(held, c.train)
    by_group = [[n for n, p in held if any(p is q for q in g["params"])] for g in opt.param_groups]
    assert all(n.endswith(".weight") and "ln" not in n for n in by_group[0])
    assert by_group[1] and all(n.endswith(".bias") for n in by_group[1])
    assert by_group[2] and all(".weight" in n and "ln" in n for n in by_group[2]), by_group
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0, 0.0]
    set_lr(opt, 2e-4)   # the schedule's rate at some step: the group of lr 5e-4 keeps its half
    assert [g["lr"] for g in opt.param_groups] == [2e-4, 2e-4, 1e-4]
    only_head = build_optimizer([(n, torch.nn.Parameter(torch.zeros(2))) for n in names if n.startswith("blocks.7.")
                                 and n.endswith("weight") and "ln" not in n], c.train)
    assert len(only_head.param_groups) == 1


def test_a_param_group_that_takes_no_parameter_is_a_config_error():
    c = cfg(optimizer={"name": "SGD", "param_groups": [{"match": "*.bias", "weight_decay": 0.0},
                                                        {"match": "*.gamma", "weight_decay": 0.0}]})
    names = model_param_names(c.model)
    with pytest.raises(ConfigError, match=r"param_groups\[1\].match\('\*.gamma'\): it matches no parameter.*blocks.0."):
        check_patterns(c.train.optimizer, names)
    shadowed = cfg(optimizer={"name": "SGD", "param_groups": [{"match": "*", "weight_decay": 0.0},
                                                               {"match": "*.bias", "weight_decay": 0.1}]})
    with pytest.raises(ConfigError, match=r"taken by param_groups\[0\] before it"):
        check_patterns(shadowed.train.optimizer, names)


ELEMENTWISE = [("SGD", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}), ("Adam", {"amsgrad": True}),
               ("AdamW", {"foreach": True}), ("AdamW", {"fused": True}), ("NAdam", {}), ("RAdam", {}),
               ("Adamax", {}), ("RMSprop", {"momentum": 0.5, "centered": True}), ("Adagrad", {}),
               ("Adadelta", {}), ("ASGD", {}), ("Rprop", {}), (LION, {"weight_decay": 0.1})]


@pytest.mark.parametrize("name, kwargs", ELEMENTWISE, ids=[f"{n.split(':')[-1]}{sorted(k)}" for n, k in ELEMENTWISE])
def test_an_elementwise_optimizer_on_slices_updates_as_on_the_whole_tensor(name, kwargs):
    """What a sharded rank does (``ShardedOptimizer``): the optimizer over views of slices of each
    parameter, named as the parameter (groups apply to the slices alike)."""
    c = cfg(optimizer={"name": name, "kwargs": kwargs, "param_groups": [{"match": "*.b", "lr": 5e-4}]}).train
    torch.manual_seed(0)
    init = {"blocks.0.w": torch.randn(5, 7), "blocks.0.b": torch.randn(7)}
    whole = {n: v.clone() for n, v in init.items()}
    sliced = {n: v.clone() for n, v in init.items()}
    views = [(n, sliced[n].view(-1)[a:z]) for n in sliced for a, z in ((0, 3), (3, sliced[n].numel()))]
    opt_whole = build_optimizer(list(whole.items()), c)
    opt_sliced = build_optimizer(views, c)
    for step in range(4):
        grads = {n: torch.randn_like(v) for n, v in init.items()}
        for n, p in whole.items():
            p.grad = grads[n].clone()
        for n, v in views:
            a = v.storage_offset()
            v.grad = grads[n].reshape(-1)[a:a + v.numel()].clone()
        set_lr(opt_whole, 1e-3 / (step + 1))
        set_lr(opt_sliced, 1e-3 / (step + 1))
        opt_whole.step()
        opt_sliced.step()
    for n in init:
        assert torch.equal(whole[n], sliced[n]), (n, (whole[n] - sliced[n]).abs().max())


def _stepped(name, kwargs, seed=0, steps=3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4))
    named = [(f"blocks.0.{n}", p) for n, p in model.named_parameters()]
    opt = build_optimizer(named, cfg(optimizer={"name": name, "kwargs": kwargs}).train)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 6)).pow(2).sum().backward()
        opt.step()
    return model, named, opt


@pytest.mark.parametrize("name, kwargs", [("Adafactor", {}), ("SGD", {"momentum": 0.9}), ("NAdam", {}), ("ASGD", {}),
                                          (LION, {})])
def test_any_optimizers_state_goes_through_a_snapshot_and_steps_on_as_if_never_stopped(name, kwargs):
    model, named, opt = _stepped(name, kwargs)
    shard = export_shard(3, named, opt, [0])
    if name == "Adafactor":   # factored state, of shapes of its own, carried whole
        assert shard["optim"]["blocks.0.0.weight"]["row_var"].shape == (4, 1)
    fresh, fresh_named, fresh_opt = _stepped(name, kwargs, seed=1, steps=0)
    step, params, optim = merge_shards([shard], [n for n, _ in fresh_named])
    load_into(fresh_named, fresh_opt, params, optim)
    for (n, p), (_, q) in zip(named, fresh_named):
        for k, v in opt.state[p].items():
            got = fresh_opt.state[q][k]
            assert (got.shape, got.dtype, got.device) == (v.shape, v.dtype, v.device) and torch.equal(got, v), (n, k)
    # Fingerprints of what was saved and what is held agree (checkpoint.verify_restores).
    shard["fingerprint"] = part_fingerprint(shard)
    assert saved_fingerprint([shard], [n for n, _ in named]) == held_fingerprint(fresh_named, fresh_opt, None)
    x = torch.randn(3, 6)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()
    for (n, p), (_, q) in zip(named, fresh_named):
        assert torch.equal(p, q), n


def test_adafactors_state_goes_through_a_durable_checkpoint(tmp_path):
    from elastic_trainer.checkpoint.durable import DurableStore

    model, named, opt = _stepped("Adafactor", {})
    store = DurableStore(str(tmp_path / "ck"))
    store.save(3, [export_shard(3, named, opt, [0])], {})
    shards, _ = store.load(3)
    _, fresh_named, fresh_opt = _stepped("Adafactor", {}, seed=1, steps=0)
    load_into(fresh_named, fresh_opt, *merge_shards(shards, [n for n, _ in fresh_named])[1:])
    for (n, p), (_, q) in zip(named, fresh_named):
        assert torch.equal(p, q) and opt.state[p].keys() == fresh_opt.state[q].keys(), n
        for k, v in opt.state[p].items():
            assert torch.equal(fresh_opt.state[q][k], v), (n, k)


def test_sgd_momentum_saved_in_slices_restores_whole_and_as_other_slices():
    model, named, opt = _stepped("SGD", {"momentum": 0.9})
    w = dict(named)["blocks.0.0.weight"]
    buf = opt.state[w]["momentum_buffer"].reshape(-1).numpy()
    flat = w.detach().reshape(-1).numpy()
    halves = [{"step": 3, "blocks": [0], "params": {"blocks.0.0.weight": flat[a:z]},
               "ranges": {"blocks.0.0.weight": [a, z, [4, 6]]},
               "optim": {"blocks.0.0.weight": {"momentum_buffer": buf[a:z]}}} for a, z in ((0, 10), (10, 24))]
    _, params, optim = merge_shards(halves, ["blocks.0.0.weight"])
    np.testing.assert_array_equal(optim["blocks.0.0.weight"]["momentum_buffer"], buf.reshape(4, 6))
    _, _, owned = merge_shards(halves, ["blocks.0.0.weight"], owned={"blocks.0.0.weight": (6, 18)})
    np.testing.assert_array_equal(owned["blocks.0.0.weight"]["momentum_buffer"], buf[6:18])


def test_state_of_another_shape_cannot_be_put_together_from_slices():
    parts = [{"step": 1, "blocks": [0], "params": {"blocks.0.w": np.zeros(z - a, np.float32)},
              "ranges": {"blocks.0.w": [a, z, [2, 3]]},
              "optim": {"blocks.0.w": {"row_var": np.zeros((2, 1), np.float32)}}} for a, z in ((0, 3), (3, 6))]
    with pytest.raises(ValueError, match=r"\['row_var'\] are not of the parameter's size"):
        merge_shards(parts, ["blocks.0.w"])


def test_the_planner_sizes_each_optimizers_state():
    assert MemoryModel.of(cfg()).optimizer == 8
    assert MemoryModel.of(cfg(optimizer={"name": "SGD", "kwargs": {"momentum": 0.9}})).optimizer == 4
    assert MemoryModel.of(cfg(optimizer={"name": "SGD"})).optimizer == 0
    assert MemoryModel.of(cfg(optimizer={"name": "Adam", "kwargs": {"amsgrad": True}})).optimizer == 12
    assert MemoryModel.of(cfg(optimizer={"name": "Adafactor"})).optimizer == 0
    assert MemoryModel.of(cfg(optimizer={"name": LION})).optimizer == 4   # its own state_floats
    assert state_floats("RMSprop", {"momentum": 0.9, "centered": True}) == 3


def test_a_parameter_server_shard_steps_the_configured_optimizer_with_its_groups():
    """comm.sync: parameter_server: the shards own the optimizer, built as the ranks build it."""
    from elastic_trainer.comm.parameter_server import ParameterServerShard

    train = {"lr": 0.1, "optimizer": {"name": "SGD", "kwargs": {"momentum": 0.9},
                                      "param_groups": [{"match": "*.b", "lr": 0.05}]}}
    init = {"blocks.0.w": np.ones((2, 3), np.float32), "blocks.0.b": np.ones(3, np.float32)}
    shard = ParameterServerShard(init, train, n_workers=1, timeout_s=10)
    shard.push(1, 0, {"blocks.0.w": np.ones((2, 3), np.float32), "blocks.0.b": np.ones(3, np.float32)})
    got = shard.pull(1)
    # The first SGD step with momentum is plain SGD; lr_at(step 1) of a constant schedule is train.lr.
    np.testing.assert_allclose(got["blocks.0.w"], 1 - 0.1)
    np.testing.assert_allclose(got["blocks.0.b"], 1 - 0.05)
    state = shard.export_state()
    assert set(state["optim"]["blocks.0.w"]) == {"momentum_buffer"}


class Picky(torch.optim.SGD):
    """A user class whose step refuses the zero gradient of the placement probe."""

    def step(self, closure=None):
        if all(float(p.grad.abs().sum()) == 0 for g in self.param_groups for p in g["params"]):
            raise RuntimeError("no zero gradients here")
        out = super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["step"] = self.state[p].get("step", torch.tensor(0.0)) + 1
        return out


def test_state_comes_back_where_the_class_keeps_it_and_by_the_older_rule_where_it_cannot_be_probed():
    from elastic_trainer.checkpoint.optim_state import placement, state_tensors

    p = torch.nn.Parameter(torch.ones(3, 2))
    asgd = torch.optim.ASGD([p])
    assert set(placement(asgd, asgd.param_groups[0], p)) == {"step", "eta", "mu", "ax"}
    picky = Picky([p], lr=0.1, momentum=0.9)
    assert placement(picky, picky.param_groups[0], p) == {}
    got = state_tensors(picky, picky.param_groups[0], p, {"step": np.float32(4), "momentum_buffer": np.ones((3, 2), np.float32)})
    assert (got["step"].dtype, got["step"].shape, got["step"].device.type) == (torch.float32, (), "cpu")
    assert (got["momentum_buffer"].dtype, got["momentum_buffer"].shape) == (torch.float32, (3, 2))
