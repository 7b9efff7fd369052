"""Parameter-server shards as Ray actors, driven by two replica threads in the driver through PSClient."""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import ray
import torch
from torch import nn

from elastic_trainer.comm.stats import CommStats
from elastic_trainer.comm.parameter_server import PSClient, assign_shards, remote_shard_class

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TRAIN = {"lr": 0.01, "weight_decay": 0.05, "betas": (0.85, 0.98), "eps": None}
STEPS = 3


@pytest.fixture(scope="module")
def local_ray(cluster):
    """The shared cluster, handed over settled: a node an earlier test killed is gone from it
    (a shard placed there would die with the node Ray had not yet declared dead)."""
    yield


def _model() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList([nn.Linear(5, 7), nn.Sequential(nn.Tanh(), nn.Linear(7, 3))])


def _named(model: nn.ModuleList) -> dict[str, nn.Parameter]:
    """Global names, as a worker's stage reports them: ``blocks.<index>.<name in block>``."""
    return {f"blocks.{i}.{n}": p for i, block in enumerate(model) for n, p in block.named_parameters()}


def _batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + replica)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def _loss(model: nn.ModuleList, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model[1](model[0](x)) - y) ** 2).mean()


def test_push_pull_matches_single_process_adamw(local_ray):
    ref = _model()
    replicas = [copy.deepcopy(ref) for _ in range(2)]
    init = {n: p.detach().numpy().copy() for n, p in _named(ref).items()}
    assignment = assign_shards({n: a.size for n, a in init.items()}, 2)
    Shard = remote_shard_class()
    shards = [Shard.remote(init, TRAIN, 2, names=[n for n in init if assignment[n] == i], shard_index=i,
                           timeout_s=30, torch_threads=1) for i in range(2)]
    clients = [PSClient(_named(m).items(), shards, assignment, r, 2, timeout_s=30) for r, m in enumerate(replicas)]
    stats = [CommStats() for _ in replicas]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=TRAIN["lr"], weight_decay=TRAIN["weight_decay"],
                                betas=TRAIN["betas"])

    def replica_step(r: int, step: int) -> None:
        m = replicas[r]
        m.zero_grad(set_to_none=True)
        _loss(m, *_batch(step, r)).backward()
        clients[r].push_pull(step, stats[r])

    with ThreadPoolExecutor(2) as pool:
        for step in range(1, STEPS + 1):
            for f in [pool.submit(replica_step, r, step) for r in range(2)]:
                f.result(timeout=60)
            ref_opt.zero_grad(set_to_none=True)
            grads = []
            for r in range(2):
                ref.zero_grad(set_to_none=True)
                _loss(ref, *_batch(step, r)).backward()
                grads.append({n: p.grad.clone() for n, p in _named(ref).items()})
            for n, p in _named(ref).items():
                p.grad = (grads[0][n] + grads[1][n]) / 2
            ref_opt.step()
            for m in replicas:
                for n, p in _named(m).items():
                    torch.testing.assert_close(p.detach(), _named(ref)[n].detach(), rtol=0, atol=1e-6, msg=n)

    nbytes = sum(a.nbytes for a in init.values())
    for s in stats:
        assert s.by_op == {"ps_push": STEPS * nbytes, "ps_pull": STEPS * nbytes}
        assert s.calls == 2 * STEPS and s.seconds > 0

    # The shards' exported state is the reference's after the last step, AdamW moments included.
    states = ray.get([s.export_state.remote(STEPS) for s in shards])
    assert [st["step"] for st in states] == [STEPS, STEPS]
    assert sorted(n for st in states for n in st["params"]) == sorted(init)
    for st in states:
        for n, a in st["params"].items():
            np.testing.assert_allclose(a, _named(ref)[n].detach().numpy(), rtol=0, atol=1e-6)
            np.testing.assert_allclose(st["optim"][n]["exp_avg"], ref_opt.state[_named(ref)[n]]["exp_avg"].numpy(),
                                       rtol=0, atol=1e-6)
    # A retried push of a step already applied is ignored by the actor too.
    assert ray.get(shards[0].push.remote(STEPS, 0, {n: np.ones_like(init[n]) for n in states[0]["params"]})) == 0
