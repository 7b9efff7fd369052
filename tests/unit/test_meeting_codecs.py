"""Local SGD and DiLoCo meetings sent in fp16 / bf16, on two gloo processes: each replica's change
since the last meeting goes in 2-byte floats, half the bytes of fp32, and the model every replica
leaves with is the same one, within the rounding of the change (never of the weights)."""

import numpy as np
import pytest
import torch

from ..helpers import spawn_ranks

SHAPES = [(40, 50), (300,), (20, 35)]


def _rank(rank, port, q):
    import torch.distributed as dist

    from elastic_trainer.comm.local_sgd import ModelAverager
    from elastic_trainer.comm.stats import CommStats
    from elastic_trainer.config import CommSection

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        out = {}
        for sync in ("local_sgd", "diloco"):
            for codec in ("none", "fp16", "bf16"):
                gen = torch.Generator().manual_seed(0)   # the same start on both ranks
                named = [(f"w{i}", torch.nn.Parameter(torch.randn(*s, generator=gen) * 3))
                         for i, s in enumerate(SHAPES)]
                avg = ModelAverager(named, None, 2, CommSection(sync=sync, compression=codec, local_steps=2))
                meetings = []
                for meeting in range(2):
                    own = torch.Generator().manual_seed(100 * rank + meeting)   # each replica its own change
                    with torch.no_grad():
                        for _, p in named:
                            p.add_(torch.randn(p.shape, generator=own) * 1e-2)
                    stats = CommStats()
                    avg.maybe_sync(2 * (meeting + 1), stats)
                    meetings.append(([p.detach().clone().numpy() for _, p in named], stats.bytes))
                out[(sync, codec)] = meetings
        q.put((rank, "ok", out))
    except Exception as e:  # noqa: BLE001 - reported to the test
        import traceback
        q.put((rank, "error", traceback.format_exc() + repr(e)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def meetings():
    got = spawn_ranks(_rank, 2)
    for rank, (status, value) in got.items():
        assert status == "ok", value
    return {r: v for r, (_, v) in got.items()}


@pytest.mark.parametrize("sync", ["local_sgd", "diloco"])
@pytest.mark.parametrize("codec, tol", [("fp16", 2e-5), ("bf16", 2e-4)])
def test_a_meeting_in_two_byte_floats_sends_half_and_leaves_every_replica_the_same_model(meetings, sync, codec, tol):
    full, half = meetings[0][(sync, "none")], meetings[0][(sync, codec)]
    for m in range(2):
        # Every replica leaves the meeting with the same model, bit for bit.
        for a, b in zip(meetings[0][(sync, codec)][m][0], meetings[1][(sync, codec)][m][0]):
            assert np.array_equal(a, b)
        # The fp32 meeting's model, up to the rounding of a change of about 1e-2 (not of weights of about 3).
        for a, b in zip(half[m][0], full[m][0]):
            assert np.abs(a - b).max() <= tol, (sync, codec, m, np.abs(a - b).max())
        assert half[m][1] * 2 == pytest.approx(full[m][1], abs=8)


@pytest.mark.parametrize("codec, tol", [("none", 4e-6), ("fp16", 2e-5)])
def test_local_sgd_leaves_each_meeting_with_the_replicas_mean(meetings, codec, tol):
    # Meeting by meeting (the 2-byte one counts each change from the last meeting's parameters it keeps).
    gen = torch.Generator().manual_seed(0)
    model = [torch.randn(*s, generator=gen) * 3 for s in SHAPES]
    for m in range(2):
        gens = [torch.Generator().manual_seed(100 * r + m) for r in range(2)]
        changes = [[torch.randn(s, generator=g) * 1e-2 for s in SHAPES] for g in gens]
        model = [w + (a + b) / 2 for w, a, b in zip(model, *changes)]
        for got, want in zip(meetings[0][("local_sgd", codec)][m][0], model):
            assert np.abs(got - want.numpy()).max() <= tol, (codec, m)
