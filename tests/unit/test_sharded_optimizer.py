"""The sharded optimizer (ZeRO-1/2) on two gloo processes at dp=2: the same steps as unsharded,
half the optimizer state per rank, snapshots that put back together under any sharding, and the
reduce-scatter and all-gather built from all-to-all equal to the backend's."""

import numpy as np
import pytest
import torch

from elastic_trainer.checkpoint.state import merge_shards
from elastic_trainer.config import TrainerConfig
from elastic_trainer.controller.state.restore_check import check_restore
from elastic_trainer.parallel.shard_ranges import owned, owned_slices, shard_len

from ..conftest import tiny_config
from ..helpers import spawn_ranks

STEPS = 3
N_BLOCKS = 8   # tiny_config's GPT: 6 layers, the embedding and the head


def _cfg(corpus, shard, dp=2, bucket_mb=0.05):
    # Parts fingerprinted, for the restores below to be checked as a run checks them.
    return TrainerConfig.from_dict(tiny_config(corpus, parallel={"dp": dp, "pp": 1, "shard_optimizer": shard},
                                               run={"output_dir": None}, comm={"bucket_mb": bucket_mb},
                                               checkpoint={"verify_restores": True}))


def _rank(rank, port, corpus, q):
    from elastic_trainer.comm.shard_exchange import ShardExchange
    from elastic_trainer.parallel.topology import Topology
    from elastic_trainer.worker.process_group import destroy_groups, init_groups
    from elastic_trainer.checkpoint.state import shard_nbytes
    from elastic_trainer.worker.snapshot_serving import cut_for_reader
    from elastic_trainer.worker.stage import StageTrainer

    torch.set_num_threads(1)   # as a Ray worker of one CPU runs
    try:
        topo = Topology(2, 1)
        groups = init_groups("gloo", "127.0.0.1", port, topo, rank, timeout_s=30)
        out = {}
        for shard in ("none", "optimizer", "gradients"):
            t = StageTrainer(_cfg(corpus, shard), topo, rank, groups, [(0, N_BLOCKS)], torch.device("cpu"))
            losses, sent = [], []
            for step in range(1, STEPS + 1):
                r = t.train_step(step)
                losses.append(r.loss)
                sent.append(r.comm_bytes)
            state_bytes = sum(v.numel() * v.element_size() for st in t.optimizer.state.values()
                              for v in st.values() if torch.is_tensor(v) and v.ndim)
            out[shard] = {"losses": losses, "state": {n: w.numpy() for n, w in t.state_dict().items()}, "state_bytes": state_bytes,
                          "part": dict(t.export(STEPS)), "sent": sent, "grads_kept": any(p.grad is not None for p in t.params)}
            t.close()
        # Re-sharding: both ranks' ZeRO-2 parts load into a ZeRO-1 rank of another bucket size
        # (other slices) and into an unsharded rank; what each then holds is exported.
        import torch.distributed as dist

        parts = [None, None]
        dist.all_gather_object(parts, out["gradients"]["part"], group=groups.dp)
        out["reloaded"], out["cut_bytes"], out["fingerprints"] = {}, {}, {}
        # And the reverse: a whole part (what an unsharded run wrote) into a ZeRO-2 rank.
        cfg = _cfg(corpus, "gradients")
        t = StageTrainer(cfg, topo, rank, groups, [(0, N_BLOCKS)], torch.device("cpu"), restoring=True)
        t.load([out["none"]["part"]])
        out["fingerprints"]["from_whole"] = t.restore_fingerprints([out["none"]["part"]])
        out["reloaded"]["from_whole"] = dict(t.export(STEPS))
        t.close()
        for shard, bucket_mb in (("optimizer", 0.02), ("none", 25)):
            cfg = _cfg(corpus, shard, bucket_mb=bucket_mb)
            t = StageTrainer(cfg, topo, rank, groups, [(0, N_BLOCKS)], torch.device("cpu"), restoring=True)
            # As a restore reads them: each part cut where it lies to the weights and the moments'
            # ranges this rank owns (whole moments for an unsharded rank).
            cut = [cut_for_reader(p, t.restore_want()) for p in parts]
            out["cut_bytes"][shard] = [(shard_nbytes(c), c["regather_nbytes"]) for c in cut]
            assert t.load(cut) == STEPS
            out["fingerprints"][shard] = t.restore_fingerprints(cut)
            out["reloaded"][shard] = dict(t.export(STEPS))
            t.close()
        # The built reduce-scatter and all-gather against the backend's.
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(10, generator=g)
        got = {}
        for built in (False, True):
            ex = ShardExchange(groups.dp, 2, built=built)
            rs = torch.empty(5)
            ex.reduce_scatter(x.clone(), rs)
            ag = torch.empty(10)
            ex.all_gather(rs, ag)
            got[built] = (rs.numpy(), ag.numpy())
        out["exchange"] = got
        destroy_groups()
        q.put((rank, "ok", out))
    except Exception:  # noqa: BLE001 - reported to the test
        import traceback

        q.put((rank, "error", traceback.format_exc()))


@pytest.fixture(scope="module")
def runs(corpus_dir):
    got = spawn_ranks(_rank, 2, corpus_dir)
    for r, (status, val) in got.items():
        assert status == "ok", f"rank {r}: {val}"
    return {r: val for r, (_, val) in got.items()}


def test_owned_ranges_tile_every_bucket():
    for numel in (1, 7, 64, 1001):
        for p in (1, 2, 3, 4, 8):
            spans = [owned(numel, p, j) for j in range(p)]
            assert spans[0][0] == 0 and spans[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert all(hi - lo <= shard_len(numel, p) for lo, hi in spans)
    # A shard that starts inside one parameter and ends inside another.
    assert owned_slices([3, 4, 5], 2, 9) == [(0, 2, 3, 0), (1, 0, 4, 1), (2, 0, 2, 5)]


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_sharded_steps_match_unsharded_with_half_the_state(runs, shard):
    for r in (0, 1):
        plain, sharded = runs[r]["none"], runs[r][shard]
        assert sharded["losses"] == pytest.approx(plain["losses"], rel=1e-6)
        for name, ref in plain["state"].items():
            np.testing.assert_allclose(sharded["state"][name], ref, rtol=1e-5, atol=1e-6)
        # The replicas hold the same weights after the all-gather, bit for bit.
        for name, w in runs[0][shard]["state"].items():
            assert np.array_equal(w, runs[1][shard]["state"][name]), name
    # Optimizer state per rank: 1/dp of unsharded, within a bucket's padding.
    unsharded = runs[0]["none"]["state_bytes"]
    for r in (0, 1):
        assert runs[r][shard]["state_bytes"] <= unsharded / 2 * 1.05
    assert runs[0][shard]["state_bytes"] + runs[1][shard]["state_bytes"] == pytest.approx(unsharded, rel=1e-3)
    # A reduce-scatter and an all-gather send what the all-reduce did.
    assert min(runs[0]["none"]["sent"]) > 0
    assert runs[0][shard]["sent"] == pytest.approx(runs[0]["none"]["sent"], rel=0.01)


def test_gradients_sharding_lets_the_full_gradients_go(runs):
    assert runs[0]["optimizer"]["grads_kept"]
    assert not runs[0]["gradients"]["grads_kept"]


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_sharded_snapshot_parts_put_back_together_equal_the_unsharded_state(runs, shard):
    plain = runs[0]["none"]["part"]
    parts = [runs[r][shard]["part"] for r in (0, 1)]
    assert all(p.get("ranges") for p in parts)
    names = list(plain["params"])
    step, params, optim = merge_shards(parts, names)
    assert step == STEPS
    for n in names:
        np.testing.assert_allclose(params[n], plain["params"][n], rtol=1e-5, atol=1e-6)
        for kind in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_allclose(optim[n][kind], plain["optim"][n][kind], rtol=1e-4, atol=1e-7)
        assert float(optim[n]["step"]) == STEPS
    with pytest.raises(ValueError, match="a shard of its sharded optimizer is missing"):
        merge_shards(parts[:1], names)


def test_built_exchange_equals_the_backends(runs):
    for r in (0, 1):
        (rs, ag), (rs_b, ag_b) = runs[r]["exchange"][False], runs[r]["exchange"][True]
        np.testing.assert_array_equal(rs, rs_b)
        np.testing.assert_array_equal(ag, ag_b)
    # And they are a reduce-scatter and an all-gather.
    np.testing.assert_array_equal(runs[0]["exchange"][False][1], runs[1]["exchange"][False][1])


def test_a_sharded_state_reloads_bit_for_bit_under_other_slices_and_unsharded(runs):
    """What a re-plan does: the parts of one sharding load into ranks of another (or none), and
    the state they then hold is the saved state, bit for bit."""
    names = list(runs[0]["none"]["part"]["params"])
    _, params, optim = merge_shards([runs[r]["gradients"]["part"] for r in (0, 1)], names)
    resharded = [runs[r]["reloaded"]["optimizer"] for r in (0, 1)]
    assert resharded[0]["ranges"] != runs[0]["gradients"]["part"]["ranges"]   # other slices
    for got in (merge_shards(resharded, names), merge_shards([runs[0]["reloaded"]["none"]], names)):
        for n in names:
            assert np.array_equal(got[1][n], params[n]), n
            for kind in ("exp_avg", "exp_avg_sq", "step"):
                assert np.array_equal(got[2][n][kind], optim[n][kind]), (n, kind)


def test_a_sharded_rank_reads_only_the_moments_it_owns(runs):
    """Cut for a ZeRO-1 rank of dp=2, each part gives its weights whole and the moments of the
    ranges the rank owns: what moves is the weights and half the moments (2/3 of a re-gather)."""
    for r in (0, 1):
        got = runs[r]["cut_bytes"]
        moved, regather = sum(m for m, _ in got["optimizer"]), sum(w for _, w in got["optimizer"])
        assert moved == pytest.approx(regather * 2 / 3, rel=0.02)
        # An unsharded reader takes every moment: the whole of each part.
        assert [m for m, _ in got["none"]] == [w for _, w in got["none"]]


@pytest.mark.parametrize("reload", ["optimizer", "none", "from_whole"])
def test_the_restore_check_finds_each_reload_equal_to_the_saved_state(runs, reload):
    """As ``checkpoint.verify_restores`` checks a run's restore: both ranks' fingerprints of what
    they hold against those of the parts they read, tensor by tensor (6 layers' weights, moments
    and steps, the embedding and the head)."""
    fps = {r: runs[r]["fingerprints"][reload] for r in (0, 1)}
    got = check_restore(fps, {0: list(range(N_BLOCKS)), 1: list(range(N_BLOCKS))})
    n_params = len(runs[0]["none"]["part"]["params"])
    assert got["differ"] == [] and got["unverified"] == 0
    # Each parameter's weights on each replica, its two moments (summed over the ranks where
    # sharded, each replica's where whole), and its step on each rank holding any of it.
    if reload == "none":
        assert got["tensors"] == n_params * 2 * 4
    else:
        assert n_params * 5 <= got["tensors"] <= n_params * 6
    # One element changed on one rank is found, and named.
    name = next(iter(runs[0]["none"]["part"]["params"]))
    fps[1]["held"][f"{name}|param"] ^= 1
    assert check_restore(fps, {0: list(range(N_BLOCKS)), 1: list(range(N_BLOCKS))})["differ"] == [f"{name}|param"]


def test_a_whole_state_loads_into_sharded_ranks_bit_for_bit(runs):
    names = list(runs[0]["none"]["part"]["params"])
    _, params, optim = merge_shards([runs[0]["none"]["part"]], names)
    _, got_p, got_o = merge_shards([runs[r]["reloaded"]["from_whole"] for r in (0, 1)], names)
    for n in names:
        assert np.array_equal(got_p[n], params[n]), n
        for kind in ("exp_avg", "exp_avg_sq", "step"):
            assert np.array_equal(got_o[n][kind], optim[n][kind]), (n, kind)
