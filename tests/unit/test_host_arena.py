"""Snapshot copy buffers within a budget: one arena per worker, reused across re-plans, never
overwriting what something still views, and pageable memory past the budget."""

import gc

import numpy as np
import torch

from elastic_trainer.checkpoint.flat import ShardExporter
from elastic_trainer.checkpoint.host_arena import ALIGN, MIN_CHUNK, HostArena
from elastic_trainer.checkpoint.state import block_of
from elastic_trainer.config import TrainerConfig
from elastic_trainer.planning.node_share import HOST_PIN_SHARE, snapshot_host_budget, workers_fit


def stage(widths, first=0, seed=0):
    """A plan's stage: blocks ``first``.. of the given widths, one AdamW step taken."""
    torch.manual_seed(seed)
    blocks = [torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    named = [(f"blocks.{first + i}.{n}", p) for i, b in enumerate(blocks) for n, p in b.named_parameters()]
    opt = torch.optim.AdamW([p for _, p in named], lr=0.1)
    x = torch.randn(3, widths[0])
    for b in blocks:
        x = b(x)
    x.square().sum().backward()
    opt.step()
    return named, opt, list(range(first, first + len(blocks)))


def addresses(shard) -> set[int]:
    return {a.ctypes.data for a in shard["params"].values()}


def within(arena, shard) -> bool:
    spans = [(c.ctypes.data, c.ctypes.data + c.nbytes) for c in arena._chunks]
    return all(any(lo <= a < hi for lo, hi in spans) for a in addresses(shard))


def test_spans_are_taken_and_given_back_coalesced():
    arena = HostArena(None)
    a, b, c = arena.take(100), arena.take(1000), arena.take(ALIGN)
    assert arena.nbytes == MIN_CHUNK and len(arena._chunks) == 1
    assert (a.offset, b.offset, c.offset) == (0, 128, 1152)
    arena.give(b)
    arena.give(a)
    assert arena._free[0][0] == (0, 1152), "two neighbours given back are one span again"
    again = arena.take(1100)
    assert again.offset == 0 and arena.nbytes == MIN_CHUNK


def test_a_replan_takes_its_buffers_from_the_same_memory():
    arena = HostArena(None)
    ex = ShardExporter(arena)
    named, opt, blocks = stage([5, 7, 3, 2])
    first = ex.export(1, named, opt, blocks, block_of)
    held = arena.nbytes
    assert within(arena, first)
    del first
    gc.collect()
    # The next plan gives this worker other blocks, of other shapes (a pipeline cut moved).
    named2, opt2, blocks2 = stage([2, 9, 4], first=3, seed=1)
    second = ex.export(2, named2, opt2, blocks2, block_of)
    assert arena.nbytes == held, "no new memory for the new layout"
    assert within(arena, second)
    for n, p in named2:
        assert np.array_equal(second["params"][n], p.detach().numpy())
        assert np.array_equal(second["optim"][n]["exp_avg"], opt2.state[p]["exp_avg"].numpy())


def test_a_copy_kept_across_a_replan_is_not_overwritten():
    arena = HostArena(None)
    ex = ShardExporter(arena)
    named, opt, blocks = stage([5, 7, 3])
    kept = ex.export(1, named, opt, blocks, block_of)   # a local copy, kept for recovery
    before = {n: a.copy() for n, a in kept["params"].items()}
    named2, opt2, blocks2 = stage([5, 7, 3], first=2, seed=2)
    second = ex.export(2, named2, opt2, blocks2, block_of)
    assert not addresses(kept) & addresses(second)
    for n, a in before.items():
        assert np.array_equal(kept["params"][n], a)
    # Let go (the controller no longer keeps its step): the next export may use its memory.
    old = addresses(kept)
    del kept
    gc.collect()
    third = ex.export(3, named2, opt2, blocks2, block_of)   # ``second`` is still viewed
    assert addresses(third) == old


def test_past_the_budget_copies_are_pageable_and_still_right():
    named, opt, blocks = stage([64, 64, 64])
    need = sum(p.nbytes * 3 for _, p in named)
    arena = HostArena(need // 2)
    ex = ShardExporter(arena)
    shard = ex.export(1, named, opt, blocks, block_of)
    assert arena.nbytes <= need // 2 and arena.overflow_bytes > 0
    assert arena.nbytes < ex.nbytes <= arena.nbytes + arena.overflow_bytes
    for n, p in named:
        assert np.array_equal(shard["params"][n], p.detach().numpy())
    del shard
    gc.collect()
    ex.sweep(set())   # every block moved away: all given back
    assert arena.overflow_bytes == 0 and arena.free_bytes == arena.nbytes


def config(over: dict) -> TrainerConfig:
    return TrainerConfig.model_validate({"data": {"path": "corpus.txt"}, **over})


def test_a_workers_budget_is_its_share_of_the_node():
    cfg = config({"scaling": {"resources_per_worker": {"CPU": 1}}})
    node = {"CPU": 4.0, "memory": 8e9}
    assert workers_fit(node, cfg) == 4
    assert snapshot_host_budget(node, cfg) == int(8e9 * HOST_PIN_SHARE / 4)
    cfg = config({"scaling": {"resources_per_worker": {"CPU": 1}, "workers_per_node": 2},
                                        "checkpoint": {"host_memory_gb": 3}})
    assert snapshot_host_budget(node, cfg) == 3 * (1 << 30) // 2
    gpus = config({"scaling": {"resources_per_worker": {"CPU": 2, "GPU": 1}}})
    assert workers_fit({"CPU": 64.0, "GPU": 8.0, "memory": 1e12}, gpus) == 8
    assert snapshot_host_budget({"CPU": 1.0}, config({})) is None, "no memory reported: no bound"
