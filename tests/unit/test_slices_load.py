"""Loading a sharded optimizer's slices: each byte copied once, and nothing the load does not own taken.

A restore that puts a parameter together from slices and then copies it into
the live tensor copies it twice; the slices are written in place instead
(``Pieces``), and moments put together from slices are new memory the
optimizer takes as it is. A whole array from a part (a read-only object-store
array, or a local copy whose buffers the next snapshot reuses) is still copied.
"""

import numpy as np
import pytest
import torch

from elastic_trainer.checkpoint.slices import Assembled, Pieces
from elastic_trainer.checkpoint.state import load_into, merge_shards

SHAPE = (6, 5)
N = 30


def _parts(cut=(0, 12, N)):
    """Two slices of one parameter and its moments, as two ranks of a sharded optimizer write them."""
    rng = np.random.default_rng(0)
    whole = {k: rng.standard_normal(N).astype(np.float32) for k in ("p", "exp_avg", "exp_avg_sq")}
    parts = []
    for lo, hi in zip(cut, cut[1:]):
        parts.append({"step": 4, "blocks": [0], "ranges": {"w": [lo, hi, list(SHAPE)]},
                      "params": {"w": whole["p"][lo:hi].copy()},
                      "optim": {"w": {"step": np.float32(4), "exp_avg": whole["exp_avg"][lo:hi].copy(),
                                      "exp_avg_sq": whole["exp_avg_sq"][lo:hi].copy()}}})
    return whole, parts


def _live():
    p = torch.nn.Parameter(torch.zeros(SHAPE))
    return [("w", p)], torch.optim.AdamW([p])


def test_slices_load_in_place_and_assembled_moments_are_taken_without_a_copy():
    whole, parts = _parts()
    named, opt = _live()
    _, params, optim = merge_shards(parts, ["w"], pieces=True)
    assert isinstance(params["w"], Pieces)
    assert isinstance(optim["w"]["exp_avg"], Assembled)
    load_into(named, opt, params, optim)
    p = named[0][1]
    assert np.array_equal(p.detach().numpy().reshape(-1), whole["p"])
    for k in ("exp_avg", "exp_avg_sq"):
        held = opt.state[p][k].numpy()
        assert np.array_equal(held.reshape(-1), whole[k])
        assert np.shares_memory(held, optim["w"][k])   # taken, not copied again


def test_a_whole_part_is_copied_so_the_live_state_never_aliases_it():
    whole, _ = _parts()
    local = {"step": 4, "blocks": [0], "params": {"w": whole["p"].reshape(SHAPE)},
             "optim": {"w": {"step": np.float32(4), "exp_avg": whole["exp_avg"].reshape(SHAPE),
                             "exp_avg_sq": whole["exp_avg_sq"].reshape(SHAPE)}}}
    named, opt = _live()
    _, params, optim = merge_shards([local], ["w"], pieces=True)
    load_into(named, opt, params, optim)
    p = named[0][1]
    before = whole["exp_avg"].copy()
    opt.state[p]["exp_avg"].add_(1.0)
    with torch.no_grad():
        p.add_(1.0)
    assert np.array_equal(whole["exp_avg"], before)   # the part (a local copy, say) is untouched
    assert not np.shares_memory(p.detach().numpy(), whole["p"])


def test_a_missing_slice_is_named_before_the_live_tensor_changes():
    _, parts = _parts()
    named, opt = _live()
    with pytest.raises(ValueError, match=r"w: the slices given hold 12 of the 30 elements .*none from element 12"):
        merge_shards(parts[:1], ["w"], pieces=True)
    assert not named[0][1].detach().any()


def test_a_non_contiguous_destination_gets_the_slices_put_together():
    whole, parts = _parts()
    base = torch.nn.Parameter(torch.zeros(SHAPE[::-1]))
    p = base.t()   # a view whose flat order is not the parameter's
    assert not p.is_contiguous()
    opt = torch.optim.AdamW([base])
    _, params, optim = merge_shards(parts, ["w"], pieces=True)
    load_into([("w", p)], opt, params, {})
    assert np.array_equal(p.detach().numpy(), whole["p"].reshape(SHAPE))
