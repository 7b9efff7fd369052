"""Every codec and algorithm runs on the device of its input; comm timing picks its clock by device.

Shapes alone are checked on ``meta`` tensors, with torch's fake process group
(its collectives move no data): any tensor a module makes on another device
than its input's is caught as it is made (a dispatch mode sees every op's
outputs), so a hard-coded device cannot hide behind an op that tolerates it.
Values are checked on CPU by the multi-process gloo tests (test_comm_algorithms).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from elastic_trainer.comm import timing
from elastic_trainer.comm.algorithms import ALGORITHMS, get_algorithm
from elastic_trainer.comm.compression import CODECS, make_codec
from elastic_trainer.comm.grad_sync import GradSync
from elastic_trainer.comm.host import host_array
from elastic_trainer.comm.local_sgd import ModelAverager
from elastic_trainer.comm.stats import CommStats
from elastic_trainer.config import CommSection

WORLD = 4
OPTIONS = {"int8": {"chunk": 64}, "topk": {"ratio": 0.05}, "powersgd": {"rank": 2}}
SHAPES = [(0, (40, 50)), (2000, (300,)), (2300, (20, 35))]  # 3000 elements: two matrices and a vector
NUMEL = 3000


@pytest.fixture(scope="module")
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    assert not dist.is_initialized()
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=1, world_size=WORLD)
    yield
    dist.destroy_process_group()


class OffDevice(TorchDispatchMode):
    """Records every tensor an op makes on another device than ``device`` (0-d host scalars,
    such as a step counter, are not allocations that follow the data)."""

    def __init__(self, device: str):
        super().__init__()
        self.device = torch.device(device)
        self.seen: list[tuple[str, str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device != self.device and t.dim() > 0:
                self.seen.append((str(func), str(t.device), tuple(t.shape)))
        return out


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name", CODECS + ("topk_sparse_reduce",))
def test_every_codec_allocates_on_its_input_device(fake_world, name, device):
    if name == "topk_sparse_reduce" and device == "cpu":
        pytest.skip("the fake backend leaves received buffers unwritten, and this exchange indexes by what it "
                    "receives; tests/unit/test_comm_algorithms.py runs it on CPU under gloo")
    codec = (make_codec("topk", ratio=0.05, exchange="sparse_reduce") if name == "topk_sparse_reduce"
             else make_codec(name, **OPTIONS.get(name, {})))
    for step in (1, 2):  # a second step uses the state the first left (residuals, PowerSGD's Q)
        flat = torch.randn(NUMEL, device=device)
        with OffDevice(device) as mode:
            codec.average(flat, None, CommStats(), bucket=0, shapes=SHAPES, step=step)
        # PowerSGD draws its cold-start Q on the host on purpose (initial_q), then moves it.
        allowed = {"aten.randn.generator"} if name == "powersgd" and step == 1 else set()
        assert [s for s in mode.seen if s[0] not in allowed] == [], name
        assert flat.device.type == device and flat.shape == (NUMEL,)
    for key, value in codec.state_dict().items():
        if value.dim() > 0:
            assert value.device.type == device, (name, key)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.parametrize("numel", [1, 1001, 4096])
def test_every_algorithm_allocates_on_its_input_device(fake_world, name, numel, device):
    fn = get_algorithm(name)
    t = torch.randn(numel, device=device)
    kwargs = {"chunk_bytes": 512} if name == "chunked" else {}  # several chunks per segment
    with OffDevice(device) as mode:
        fn(t, None, CommStats(), **kwargs)
        fn(torch.randn(numel, 2, device=device).t(), None, CommStats(), **kwargs)  # not contiguous
    assert mode.seen == []


def test_codec_state_restored_on_the_host_moves_to_the_bucket_device(fake_world):
    codec = make_codec("int8", chunk=64)
    codec.load_state_dict({"residual.0": torch.zeros(NUMEL)})   # as a snapshot brings it back
    codec.average(torch.empty(NUMEL, device="meta"), None, CommStats(), bucket=0)
    assert codec.state_dict()["residual.0"].device.type == "meta"


def _named(device: str) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"blocks.0.w{i}", torch.nn.Parameter(torch.zeros(*s, device=device)))
            for i, s in enumerate([(40, 50), (300,), (20, 35)])]


def test_grad_sync_averages_and_restores_on_the_parameters_device(fake_world):
    named = _named("meta")
    for p in (p for _, p in named):
        p.grad = torch.zeros_like(p)
    comm = CommSection(compression="int8", overlap=False)
    sync = GradSync(named, None, WORLD, comm, accumulations=1)
    assert sync.device.type == "meta"
    saved = {"codec": "int8", "buckets": {}, "residual": {n: np.ones(p.numel(), np.float32) for n, p in named}}
    assert sync.load_state(saved, {n for n, _ in named}) == len(named)
    with OffDevice("meta") as mode:
        sync.begin_step(1)
        sync.finish(CommStats())
    assert mode.seen == []
    assert all(p.grad.device.type == "meta" for _, p in named)


def test_model_averaging_runs_on_the_parameters_device(fake_world):
    for sync in ("local_sgd", "diloco"):
        named = _named("meta")
        avg = ModelAverager(named, None, WORLD, CommSection(sync=sync, local_steps=2))
        with OffDevice("meta") as mode:
            avg.maybe_sync(2, CommStats())
        assert mode.seen == [], sync


def test_state_leaves_any_device_as_host_arrays():
    a = host_array(torch.arange(6, dtype=torch.bfloat16).view(2, 3))
    assert isinstance(a, np.ndarray) and a.dtype == np.float32 and a.tolist() == [[0, 1, 2], [3, 4, 5]]
    src = torch.ones(3)
    b = host_array(src)
    b[0] = 5  # a copy, never a view of live state
    assert src[0] == 1
    named = _named("cpu")
    avg = ModelAverager(named, None, 1, CommSection(sync="diloco", local_steps=2))
    state = avg.export_state()
    assert all(isinstance(v, np.ndarray) for kind in state.values() for v in kind.values())


def test_comm_time_uses_cuda_events_for_cuda_tensors_and_the_wall_clock_elsewhere(monkeypatch):
    assert timing.timer_kind(torch.device("cuda", 1)) == "cuda_event"
    assert timing.timer_kind("cuda") == "cuda_event"
    assert timing.timer_kind("cpu") == "wall"
    assert timing.timer_kind("meta") == "wall"
    made = []

    class Recorded(timing.EventTimer):   # no CUDA here: record which clock start_timer picks
        def __init__(self, device):
            made.append(device)

    monkeypatch.setattr(timing, "EventTimer", Recorded)
    assert isinstance(timing.start_timer("cuda:0"), Recorded) and made == [torch.device("cuda", 0)]
    assert isinstance(timing.start_timer(torch.device("cpu")), timing.WallTimer)


def test_codecs_time_with_the_clock_of_their_tensors_device(fake_world, monkeypatch):
    from elastic_trainer.comm import codec as codec_mod
    from elastic_trainer.comm import algorithms as algo_mod
    devices = []

    def spy(device):
        devices.append(torch.device(device))
        return timing.WallTimer()

    monkeypatch.setattr(codec_mod, "start_timer", spy)
    monkeypatch.setattr(algo_mod, "start_timer", spy)
    for name in CODECS:
        make_codec(name, **OPTIONS.get(name, {})).average(torch.empty(NUMEL, device="meta"), None, CommStats(),
                                                          bucket=0, shapes=SHAPES, step=1)
    get_algorithm("tree")(torch.empty(100, device="meta"), None, CommStats())
    assert devices and all(d.type == "meta" for d in devices)


def test_comm_stats_read_pending_timers_once():
    stats = CommStats()
    stats.add("all_reduce", 8, 0.5)
    t = timing.WallTimer()
    stats.add("all_gather", 4, t.stop())
    other = CommStats()
    other.add("all_reduce", 2, 0.25)
    stats.merge(other)
    assert stats.bytes == 14 and stats.calls == 3 and stats.by_op == {"all_reduce": 10, "all_gather": 4}
    assert stats.seconds == pytest.approx(0.75 + t.seconds())
    assert stats.seconds == pytest.approx(0.75 + t.seconds())  # settled once, not added twice
    with pytest.raises(RuntimeError, match="before stop"):
        timing.WallTimer().seconds()
