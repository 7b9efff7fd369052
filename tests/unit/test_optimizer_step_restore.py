"""AdamW's ``step`` counter comes back from a snapshot or checkpoint where torch itself keeps it:
a CPU tensor unless the param group is capturable or fused (then on the parameter's device).

On this CPU-only machine the parameters' device is the CPU, so a restore that put ``step`` on
the parameter's device would pass the round-trip tests below by coincidence: the meta-device
tests and the placement rule's answers for a CUDA group are what tell the two apart here.
"""

import pickle

import numpy as np
import pytest
import torch
from torch import nn

from elastic_trainer.checkpoint.durable import DurableStore
from elastic_trainer.checkpoint.flat import ShardExporter
from elastic_trainer.checkpoint.state import block_of, export_shard, load_into, step_placement


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(6, 8, generator=g)


def _trained(seed, steps, **opt_kwargs):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **opt_kwargs)
    for i in range(steps):
        _train_step(model, opt, i)
    named = [(f"blocks.{n}", p) for n, p in model.named_parameters()]
    return model, opt, named


def _train_step(model, opt, i):
    opt.zero_grad(set_to_none=True)
    model(_batch(i)).square().mean().backward()
    opt.step()


def _bits(t):
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _round_trip(named, opt, how, tmp_path):
    if how == "flat":
        shard = pickle.loads(pickle.dumps(ShardExporter().export(3, named, opt, [0, 2], block_of)))
    elif how == "durable":
        store = DurableStore(str(tmp_path / "ck"))
        store.save(3, [ShardExporter().export(3, named, opt, [0, 2], block_of)], {"history": []})
        shard = store.load_latest()[0][0]
    else:
        shard = pickle.loads(pickle.dumps(export_shard(3, named, opt, [0, 2])))
    if how == "number":
        # A step stored as a plain number: what export_shard writes (np.asarray) for a state value
        # that is not a tensor, as torch's own step was before 1.12.
        for st in shard["optim"].values():
            st["step"] = np.asarray(float(st["step"]))
    return shard


OPTIMIZERS = [{}, {"foreach": True}, {"fused": True}]


@pytest.mark.parametrize("opt_kwargs", OPTIMIZERS, ids=["default", "foreach", "fused"])
@pytest.mark.parametrize("how", ["copy", "flat", "durable", "number"])
def test_a_restored_step_is_the_tensor_torch_keeps_and_training_continues_bitwise(tmp_path, how, opt_kwargs):
    model, opt, named = _trained(0, 3, **opt_kwargs)
    shard = _round_trip(named, opt, how, tmp_path)
    fresh, fresh_opt, fresh_named = _trained(1, 0, **opt_kwargs)
    load_into(fresh_named, fresh_opt, shard["params"], shard["optim"])

    # What torch itself holds after a real step, under the same options.
    _, ref_opt, ref_named = _trained(2, 1, **opt_kwargs)
    for (name, p), (_, q) in zip(fresh_named, ref_named):
        got, want = fresh_opt.state[p]["step"], ref_opt.state[q]["step"]
        assert torch.is_tensor(got), name
        assert (got.dtype, got.device, got.shape) == (want.dtype, want.device, want.shape), name
        assert got.item() == 3.0

    for i in range(3, 6):
        _train_step(model, opt, i)
        _train_step(fresh, fresh_opt, i)
    for (name, p), (_, q) in zip(named, fresh_named):
        assert _bits(p) == _bits(q), name
        for k, v in opt.state[p].items():
            w = fresh_opt.state[q][k]
            assert (v.dtype, v.device) == (w.dtype, w.device) and _bits(v) == _bits(w), (name, k)


def _meta_optimizer(**kwargs):
    p = nn.Parameter(torch.empty(4, 3, device="meta"))
    return p, torch.optim.AdamW([p], **kwargs)


def _state(step_dtype=np.float32):
    return {"exp_avg": np.zeros((4, 3), np.float32), "exp_avg_sq": np.zeros((4, 3), np.float32),
            "step": np.asarray(5.0, step_dtype)}


def test_on_another_device_a_plain_groups_step_stays_on_the_cpu():
    # The meta device stands in for a GPU: a step put on the parameter's device lands there.
    p, opt = _meta_optimizer()
    load_into([("blocks.0.w", p)], opt, {"blocks.0.w": np.zeros((4, 3), np.float32)}, {"blocks.0.w": _state()})
    ref_p, ref = _meta_optimizer()
    ref_p.grad = torch.zeros_like(ref_p)
    ref.step()   # torch's own first step, on the meta device
    got, want = opt.state[p]["step"], ref.state[ref_p]["step"]
    assert (got.device, got.dtype) == (want.device, want.dtype) == (torch.device("cpu"), torch.float32)
    assert got.item() == 5.0
    assert opt.state[p]["exp_avg"].device == p.device   # the moments do go to the parameter's device


@pytest.mark.parametrize("option", ["capturable", "fused"])
def test_on_another_device_a_capturable_or_fused_groups_step_goes_with_the_parameter(option):
    p, opt = _meta_optimizer(**{option: True})
    load_into([("blocks.0.w", p)], opt, {"blocks.0.w": np.zeros((4, 3), np.float32)},
              {"blocks.0.w": _state(np.float64)})
    # torch cannot step on the meta device with these options; its own load_state_dict is the reference.
    ref_p, ref = _meta_optimizer(**{option: True})
    ref.load_state_dict({"state": {0: {"exp_avg": torch.zeros(4, 3), "exp_avg_sq": torch.zeros(4, 3),
                                       "step": torch.tensor(5.0, dtype=torch.float64)}},
                         "param_groups": ref.state_dict()["param_groups"]})
    got, want = opt.state[p]["step"], ref.state[ref_p]["step"]
    assert (got.device, got.dtype) == (want.device, want.dtype) == (torch.device("meta"), torch.float32)


@pytest.mark.parametrize("group, dtype, device", [
    ({"capturable": False, "fused": None}, torch.float32, "cpu"),
    ({"capturable": True, "fused": None}, torch.float32, "cuda:1"),
    ({"capturable": False, "fused": True}, torch.float32, "cuda:1"),
    ({}, torch.float32, "cpu"),
])
def test_the_placement_rule_for_a_cuda_group(group, dtype, device):
    assert step_placement(torch.device("cuda", 1), group) == (dtype, torch.device(device))


def test_the_placement_rule_follows_a_float64_default_dtype_as_torch_does():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _, opt, named = _trained(0, 1)
        want = opt.state[named[0][1]]["step"]
        assert step_placement(torch.device("cuda", 0), {}) == (want.dtype, want.device) == (torch.float64,
                                                                                           torch.device("cpu"))
        # fused keeps float32 whatever the default
        assert step_placement(torch.device("cuda", 0), {"fused": True})[0] == torch.float32
    finally:
        torch.set_default_dtype(before)
