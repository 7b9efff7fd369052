"""A block's forward under autocast and activation checkpointing: same names, same numbers."""

import pytest
import torch
from torch import nn

from elastic_trainer.config import ModelSection
from elastic_trainer.models import build_model
from elastic_trainer.worker.block_forward import AUTOCAST_DTYPES, autocast_call, wrap_block


def _gpt(precision="fp32", checkpointing="none", dropout=0.0):
    blocks, loss_fn = build_model(ModelSection(n_layer=3, n_head=2, d_model=32, seq_len=16, dropout=dropout), seed=3)
    for b in blocks:
        wrap_block(b, precision, checkpointing)
    return nn.Sequential(*blocks), autocast_call(loss_fn, AUTOCAST_DTYPES[precision])


def _steps(model, loss_fn, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(n):
        x = torch.randint(0, 256, (4, 16), generator=g)
        y = torch.randint(0, 256, (4, 16), generator=g)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpointed_blocks_train_like_plain_ones(precision):
    torch.manual_seed(0)  # dropout draws the same masks in forward and in the recompute
    plain, plain_state = _steps(*_gpt(precision, dropout=0.1))
    torch.manual_seed(0)
    ckpt, ckpt_state = _steps(*_gpt(precision, "blocks", dropout=0.1))
    assert ckpt == pytest.approx(plain, rel=1e-6, abs=0)
    assert plain_state.keys() == ckpt_state.keys()  # wrapping renames nothing
    for k in plain_state:
        torch.testing.assert_close(ckpt_state[k], plain_state[k], rtol=1e-6, atol=1e-7)


def test_checkpointing_keeps_only_block_inputs_for_backward():
    def saved_bytes(model):
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size())
            return t

        x = torch.randint(0, 256, (4, 16))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x).sum()
        return sum(total)

    plain, _ = _gpt()
    ckpt, _ = _gpt(checkpointing="blocks")
    assert saved_bytes(ckpt) < saved_bytes(plain) / 4


def test_bf16_blocks_match_one_autocast_around_the_whole_model():
    model, loss_fn = _gpt("bf16")
    ref_blocks, ref_loss = build_model(ModelSection(n_layer=3, n_head=2, d_model=32, seq_len=16), seed=3)
    ref = nn.Sequential(*ref_blocks)
    x, y = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    loss = loss_fn(model(x), y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = ref_loss(ref(x), y)
    assert loss.dtype == torch.float32 and loss.item() == expected.item()
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    loss.backward()
    expected.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad), n


def test_unknown_settings_are_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match="fp32, bf16"):
        wrap_block(nn.Linear(2, 2), "fp8", "none")
    with pytest.raises(ValueError, match="'none' or 'blocks'"):
        wrap_block(nn.Linear(2, 2), "fp32", "layers")


def test_fp16_refuses_comm_modes_that_cannot_drop_an_overflowed_step():
    from elastic_trainer import ConfigError, TrainerConfig

    base = {"data": {"path": "x"}, "train": {"precision": "fp16"}}
    TrainerConfig.from_dict({**base, "comm": {"compression": "bf16"}})
    for comm in ({"compression": "topk"}, {"sync": "diloco"}, {"sync": "parameter_server"}):
        with pytest.raises(ConfigError, match="train.precision 'fp16' skips steps whose gradients overflow"):
            TrainerConfig.from_dict({**base, "comm": comm})


def test_the_loss_scale_backs_off_on_an_overflow_grows_after_good_steps_and_round_trips():
    from elastic_trainer.worker.loss_scale import LossScaler

    s = LossScaler(1024.0, growth_interval=2)
    s.update(True)
    assert s.scale == 512.0
    s.update(False)
    s.update(False)
    assert (s.scale, s.growth_tracker) == (1024.0, 0)
    s.update(False)
    g = [torch.full((2,), 1024.0)]
    s.unscale_(g)
    assert torch.equal(g[0], torch.ones(2))
    fresh = LossScaler(65536.0, 2)
    fresh.load_state_dict(s.state_dict())
    assert (fresh.scale, fresh.growth_tracker) == (1024.0, 1)
    fresh.load_state_dict({})  # a snapshot of a run without scaling leaves it
    assert fresh.scale == 1024.0
