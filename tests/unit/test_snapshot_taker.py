"""Snapshots off the critical path: a copy or a tensor loan that overlaps the next step and still holds step N."""

import pickle
import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

from elastic_trainer.checkpoint.tensor_loan import LEND_MIN_BYTES, TensorLoan
from elastic_trainer.checkpoint.state import merge_shards
from elastic_trainer.worker.snapshot_taker import SnapshotTaker, SnapshotTimeout


def _model():
    torch.manual_seed(0)
    blocks = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))  # weights big enough to be lent
    named = [(f"blocks.{n}", p) for n, p in blocks.named_parameters()]
    opt = torch.optim.AdamW(blocks.parameters(), lr=0.1)
    return blocks, named, opt


def _train(blocks, opt, update=True):
    opt.zero_grad()
    blocks(torch.randn(8, 256)).square().mean().backward()
    if update:
        opt.step()


def _state(named, opt):
    return ({n: p.detach().clone() for n, p in named},
            {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in named})


def _assert_holds(shard, named, expected):
    params, moments = expected
    _, got, optim = merge_shards([shard], [n for n, _ in named])
    for n, _ in named:
        assert torch.equal(torch.from_numpy(np.array(got[n])), params[n]), n
        for k, v in moments[n].items():
            assert torch.equal(torch.from_numpy(np.array(optim[n][k])).reshape(v.shape), v), (n, k)


def test_a_lease_ends_when_the_last_view_or_pickle_buffer_is_gone():
    t = torch.arange(LEND_MIN_BYTES // 4, dtype=torch.float32)
    loan = TensorLoan()
    view = loan.view(t)
    assert np.array_equal(view, t.numpy()) and not view.flags.writeable
    buffers = []
    pickle.dumps({"a": view}, protocol=5, buffer_callback=buffers.append)
    sub = view[10:20]
    del view
    assert not loan.wait(0.01) and loan.outstanding == 1
    del sub
    assert not loan.wait(0.01)  # the pickle buffers still read the tensor
    del buffers
    assert loan.wait(1.0) and loan.outstanding == 0


def test_a_lease_keeps_its_tensor_alive_and_lends_bf16_as_bits():
    loan = TensorLoan()
    t = torch.randn(LEND_MIN_BYTES).to(torch.bfloat16)
    expect = t.view(torch.int16).clone()
    view = loan.view(t)
    del t  # the view's memory is the tensor's: the loan holds it
    assert view.dtype == np.int16 and np.array_equal(view, expect.numpy())
    with pytest.raises(ValueError, match="contiguous CPU"):
        loan.view(torch.randn(256, 256).t())
    small = torch.ones(3)
    copied = loan.view(small)  # small tensors are copied, not lent
    small.add_(1)
    assert copied.tolist() == [1.0, 1.0, 1.0] and loan.outstanding == 1


def test_a_copy_that_overlaps_the_next_backward_holds_the_state_of_its_step():
    blocks, named, opt = _model()
    _train(blocks, opt)
    expected = _state(named, opt)
    taker = SnapshotTaker(torch.device("cpu"), wait_timeout_s=10)
    job = taker.begin(1, False, named, opt, [0, 1], {}, {}, {})
    _train(blocks, opt, update=False)   # the next step's forward and backward run beside the copy
    waited = taker.wait()                # the barrier before the update
    opt.step()
    assert waited >= 0 and job.done()
    _assert_holds(job.copied(), named, expected)
    assert taker.buffer_bytes >= sum(p.nbytes * 3 for _, p in named)
    taker.close()


def test_a_lent_state_waits_for_its_reader_before_the_update_changes_it():
    blocks, named, opt = _model()
    _train(blocks, opt)
    expected = _state(named, opt)
    taker = SnapshotTaker(torch.device("cpu"), wait_timeout_s=10)
    job = taker.begin(1, True, named, opt, [0, 1], {"scale": 1.0}, {}, {})
    written = {}

    def reader():  # stands in for Ray writing the returned part into the object store
        part = job.take_part()
        # A slow writer, on purpose: without the barrier the update would land in its read.
        time.sleep(0.3)
        buffers = []
        head = pickle.dumps(part, protocol=5, buffer_callback=buffers.append)
        written["shard"] = pickle.loads(head, buffers=[bytes(b.raw()) for b in buffers])
        written["at"] = time.perf_counter()   # read; the lent buffers are let go as it returns

    th = threading.Thread(target=reader)
    th.start()
    _train(blocks, opt, update=False)
    taker.wait()
    updated_at = time.perf_counter()
    opt.step()
    th.join()
    assert written["at"] < updated_at  # the update waited for the write
    _assert_holds(written["shard"], named, expected)
    taker.close()


def test_a_lent_part_nobody_reads_fails_the_barrier_clearly():
    blocks, named, opt = _model()
    _train(blocks, opt)
    taker = SnapshotTaker(torch.device("cpu"), wait_timeout_s=0.2)
    taker.begin(7, True, named, opt, [0, 1], {}, {}, {})
    with pytest.raises(SnapshotTimeout, match="step 7.*still reads the live state.*nobody took the part"):
        taker.wait()
    taker.close()
