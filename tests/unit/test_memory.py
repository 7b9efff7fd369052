"""Worker memory: activations measured on the meta device, micro-batches in flight per schedule, the bound."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from elastic_trainer.config import TrainerConfig
from elastic_trainer.config.training import ParallelSection
from elastic_trainer.errors import ConfigError
from elastic_trainer.models import build_model
from elastic_trainer.planning.layouts import Layout, NothingFits
from elastic_trainer.planning.memory import MemoryModel, RankMemory, in_flight, rank_memory
from elastic_trainer.planning.model_shape import ModelShape, model_shape
from elastic_trainer.planning.planner import predict_candidates


def small() -> TrainerConfig:
    return TrainerConfig.model_validate({
        "data": {"path": "x", "seq_len": 16},
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16},
        "train": {"global_batch_size": 8, "micro_batch_size": 2},
    })


def _real_saved_bytes(cfg: TrainerConfig) -> list[int]:
    """The same count on real CPU tensors, with storages told apart by their data pointers."""
    blocks, loss_fn = build_model(cfg.model, seed=0)
    x = ids = torch.zeros(cfg.train.micro_batch_size, cfg.data.seq_len, dtype=torch.long)
    out = []
    for i, b in enumerate(blocks):
        state = {t.untyped_storage().data_ptr() for t in [*b.parameters(), *b.buffers()]}
        seen = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in state:
                seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = b(x)
            if i == len(blocks) - 1:
                loss_fn(x, ids)
        out.append(sum(seen.values()))
    return out


def test_activations_measured_on_meta_match_a_real_forward():
    cfg = small()
    shape = model_shape(cfg)
    # On meta, attention runs SDPA's math kernel; with the same kernel a real forward saves the same bytes.
    with sdpa_kernel(SDPBackend.MATH):
        assert list(shape.saved_bytes) == _real_saved_bytes(cfg)
    # A fused kernel saves less (no T x T probabilities): the meta count is an upper bound.
    assert all(m >= r for m, r in zip(shape.saved_bytes, _real_saved_bytes(cfg)))
    # What crosses a boundary: (micro_batch, seq_len, d_model) fp32, then the logits.
    assert shape.out_bytes[1] == 2 * 16 * 32 * 4 and shape.out_bytes[-1] == 2 * 16 * 256 * 4
    assert model_shape(cfg) is shape  # cached


def test_micro_batches_in_flight_follow_the_schedule():
    assert in_flight("gpipe", 8, 1, 0) == in_flight("1f1b", 8, 1, 0) == 1  # no pipeline: one at a time
    assert [in_flight("gpipe", 8, 4, s) for s in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", 8, 4, s) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 2, 4, s) for s in range(4)] == [2, 2, 2, 1]


def test_rank_memory_is_state_plus_live_activations():
    # Four blocks of 10 parameters each making 100 bytes of saved tensors and 7 of output.
    shape = ModelShape((((10,),),) * 4, (7,) * 4, (100,) * 4)
    lay = Layout(dp=1, pp=2, stage_bounds=((0, 2), (2, 4)), micro_batches=4)
    stage = 2 * 100 + 7
    acts = lambda ranks: [m.activations for m in ranks]  # noqa: E731
    assert acts(rank_memory(lay, shape, "1f1b")) == [2 * stage, stage]
    assert acts(rank_memory(lay, shape, "gpipe")) == [4 * stage] * 2
    # Interleaved, 2 virtual stages a rank, 4 micro-batches in 2 rounds of 2: rank 0 warms up with
    # (2-1)*2 + 2*(2-1) = 4 forwards and runs one more before its first backward; rank 1 with 2, then 1.
    inter = Layout(dp=1, pp=2, stage_bounds=((0, 1), (1, 2), (2, 3), (3, 4)), micro_batches=4, stages_per_rank=2)
    one = 100 + 7
    assert acts(rank_memory(inter, shape, "interleaved")) == [5 * one, 3 * one]


def test_every_buffer_is_counted_and_host_and_device_apart():
    shape = ModelShape((((10,),),) * 4, (7,) * 4, (100,) * 4)
    one = Layout(dp=1, pp=2, stage_bounds=((0, 2), (2, 4)), micro_batches=4)
    two = Layout(dp=2, pp=2, stage_bounds=((0, 2), (2, 4)), micro_batches=2)
    cpu = MemoryModel(runtime=1000)
    r0 = rank_memory(one, shape, "1f1b", model=cpu)[0]
    # 20 parameters: fp32 weights, grads, two moments. No replica shares the snapshot parts, so a CPU
    # rank lends its live tensors and keeps no local copy; the 2 kept parts it put into its node's
    # store (weights + moments each), and the next while it is put, are in its resident set; the
    # other replica's are on another node.
    assert (r0.weights, r0.grads, r0.optimizer, r0.buckets, r0.snapshots) == (80, 80, 160, 0, 3 * 240)
    assert r0.object_store == 2 * 240
    assert r0.device == 80 + 80 + 160 + 2 * 207 and r0.host == r0.device + 720 + 1000 == r0.bounded
    # With replicas: the gradient buckets' fp32 copies, a codec's residual (which snapshots carry
    # too: 16 bytes a parameter each), two local snapshot copies, and half the parts put.
    int8 = MemoryModel(extra=4, runtime=0)
    r0 = rank_memory(two, shape, "1f1b", model=int8)[0]
    assert (r0.buckets, r0.extra, r0.snapshots, r0.object_store) == (80, 80, 2 * 320 + 3 * 160, 320)
    # A residual needs a peer; DiLoCo keeps its outer state without one.
    assert rank_memory(one, shape, "1f1b", model=int8)[0].extra == 0
    assert rank_memory(one, shape, "1f1b", model=MemoryModel(extra=8, extra_alone=True))[0].extra == 160
    # On a GPU the bound holds the device; the (pinned) snapshot copies and the process are host memory.
    gpu = rank_memory(one, shape, "1f1b", model=MemoryModel(gpu=True, runtime=1000))[0]
    assert gpu.bounded == gpu.device == 320 + 2 * 207 and gpu.host == 2 * 240 + 3 * 240 + 1000
    cfg = TrainerConfig.model_validate({**small().model_dump(), "comm": {"compression": "int8"},
                                        "checkpoint": {"snapshots_kept": 1}})
    m = MemoryModel.of(cfg)
    assert (m.extra, m.snapshots_kept, m.snapshot_bytes, m.buckets, m.gpu) == (4, 1, 12, 4, False)
    assert isinstance(r0, RankMemory) and r0.parts()["grad_buckets"] == 80


def test_a_memory_bound_drops_layouts_and_names_what_would_fit():
    cfg = small().model_copy(update={"parallel": ParallelSection(shard_optimizer="none")})
    rows = predict_candidates(cfg, 4)
    need = sorted({r["memory_bytes"] for r in rows})
    bound = need[len(need) // 2]
    kept = predict_candidates(cfg, 4, worker_memory_bytes=bound)
    assert kept and all(r["memory_bytes"] <= bound for r in kept)
    assert {(r["dp"], r["pp"]) for r in kept} < {(r["dp"], r["pp"]) for r in rows}
    smallest = min(rows, key=lambda r: r["memory_bytes"])
    with pytest.raises(NothingFits, match=rf"no dp x pp on 4 worker\(s\) fits 0\.0 MiB per worker; the smallest, "
                                          rf"dp={smallest['dp']} pp={smallest['pp']}, needs"):
        predict_candidates(cfg, 4, worker_memory_bytes=1)
    with pytest.raises(ConfigError, match="worker_memory_bytes must be > 0 or None; got 0"):
        predict_candidates(cfg, 4, worker_memory_bytes=0)


def test_activation_checkpointing_trades_activation_memory_for_a_recomputed_forward():
    cfg = small()
    ckpt = cfg.model_copy(update={"train": cfg.train.model_copy(update={"activation_checkpointing": "blocks"})})
    plain_rows = {(r["dp"], r["pp"]): r for r in predict_candidates(cfg, 2, only_configured=True)}
    ckpt_rows = {(r["dp"], r["pp"]): r for r in predict_candidates(ckpt, 2, only_configured=True)}
    shape = model_shape(cfg)
    for key, plain in plain_rows.items():
        got = ckpt_rows[key]
        assert got["activation_bytes"] < plain["activation_bytes"]
        assert got["memory_bytes"] < plain["memory_bytes"]
        assert got["compute_s"] > plain["compute_s"]
    # One worker, no pipeline: the inputs of blocks 1.. kept, plus the largest block's saved tensors once.
    one = ckpt_rows[(1, 1)]
    assert one["activation_bytes"] == sum(shape.out_bytes[:-1]) + max(shape.saved_bytes)
    assert one["memory_bytes"] - one["activation_bytes"] == plain_rows[(1, 1)]["memory_bytes"] - plain_rows[(1, 1)]["activation_bytes"]


def test_a_sharded_optimizer_holds_1_over_dp_of_the_moments_and_auto_shards_only_what_must():
    cfg = small()
    lay = Layout(2, 1, ((0, 4),), 2)
    shape = model_shape(cfg)
    plain, = rank_memory(lay, shape, "1f1b", model=MemoryModel(runtime=0))
    zero, = rank_memory(lay, shape, "1f1b", model=MemoryModel(runtime=0, shard="gradients"))
    assert zero.optimizer == plain.optimizer // 2 and zero.buckets == plain.buckets // 2
    assert zero.weights == plain.weights and zero.grads == plain.grads
    # Each rank's snapshot is its slice: 1/dp of the parts, and on a CPU no local copy (it lends).
    assert zero.parts_put == plain.parts_put and zero.snapshots < plain.snapshots
    # auto: unsharded where it fits, sharded where only that fits, and never at dp=1.
    rows = predict_candidates(cfg, 2)
    assert {r["shard_optimizer"] for r in rows} == {"none"}
    two = next(r for r in rows if (r["dp"], r["pp"], r["compression"], r["sync"]) == (2, 1, "none", "allreduce"))
    sharded = {r["dp"]: r for r in predict_candidates(cfg.model_copy(update={"parallel": ParallelSection(
        shard_optimizer="gradients")}), 2) if r["pp"] == 1 and (r["compression"], r["sync"]) == ("none", "allreduce")}
    bound = (sharded[2]["memory_bytes"] + two["memory_bytes"]) / 2
    tight = predict_candidates(cfg, 2, worker_memory_bytes=bound)
    got = {(r["dp"], r["pp"], r["compression"]): r for r in tight if r["sync"] == "allreduce"}
    assert got[(2, 1, "none")]["shard_optimizer"] == "gradients"
    assert got[(2, 1, "none")]["memory_unsharded_bytes"] == two["memory_bytes"] > bound
    assert (2, 1, "int8") not in got   # a codec that cannot shard does not fit
    assert all(r["shard_optimizer"] == "none" for r in tight if r["dp"] == 1)
