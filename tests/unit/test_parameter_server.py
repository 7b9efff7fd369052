"""Parameter-server shard and client without Ray: replicas are threads calling the shard directly."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import torch

from elastic_trainer.checkpoint.state import export_shard
from elastic_trainer.comm.stats import CommStats
from elastic_trainer.comm.parameter_server import ParameterServerShard, PSClient, assign_shards

from ..helpers import blocked_in_wait

TRAIN = {"lr": 0.05, "weight_decay": 0.1, "betas": (0.8, 0.95), "eps": 1e-6}
SHAPES = {"blocks.0.weight": (3, 4), "blocks.0.bias": (3,), "blocks.1.weight": (2, 3)}
STAGE0 = ["blocks.0.bias", "blocks.0.weight"]
STAGE1 = ["blocks.1.weight"]


def _init_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def _grads(step: int, replica: int, names=SHAPES) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 * step + replica)
    return {n: rng.standard_normal(SHAPES[n]).astype(np.float32) for n in names}


class Reference:
    """One process, one AdamW, stepped on the mean of the replicas' gradients."""

    def __init__(self, params: dict[str, np.ndarray]):
        self.params = {n: torch.nn.Parameter(torch.tensor(a)) for n, a in params.items()}
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=TRAIN["lr"], weight_decay=TRAIN["weight_decay"],
                                     betas=TRAIN["betas"], eps=TRAIN["eps"])

    def step(self, per_replica: list[dict[str, np.ndarray]]) -> None:
        for n, p in self.params.items():
            p.grad = sum(torch.tensor(g[n]) for g in per_replica) / len(per_replica)
        self.opt.step()


def _run_replicas(fn, n: int = 2) -> list:
    with ThreadPoolExecutor(n) as pool:
        return [f.result(timeout=30) for f in [pool.submit(fn, r) for r in range(n)]]


def _assert_params_equal(got: dict[str, np.ndarray], ref: Reference, names=SHAPES) -> None:
    for n in names:
        assert torch.equal(torch.from_numpy(np.asarray(got[n])), ref.params[n].detach()), n


# -- assignment ---------------------------------------------------------------
def test_assign_shards_balances_largest_first_and_is_deterministic():
    sizes = {"e": 1, "a": 10, "c": 5, "b": 9, "d": 4}
    got = assign_shards(sizes, 2)
    # a->0, b->1, c->1 (9 < 10), d->0 (10 < 14), e->0 (14 == 14, equal counts, lower index)
    assert got == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}
    assert assign_shards(dict(reversed(list(sizes.items()))), 2) == got
    assert sorted(assign_shards(sizes, 7).values()) == [0, 1, 2, 3, 4]


def test_assign_shards_rejects_bad_input():
    with pytest.raises(ValueError, match=r"n_shards\(0\)"):
        assign_shards({"a": 1}, 0)
    with pytest.raises(ValueError, match="'a': -1"):
        assign_shards({"a": -1}, 2)


# -- the shard ----------------------------------------------------------------
def test_two_replicas_match_single_process_adamw_on_averaged_grads():
    init = _init_params()
    shard = ParameterServerShard(init, TRAIN, n_workers=2, timeout_s=10)
    ref = Reference(init)
    for step in (1, 2, 3):
        def replica(r):
            assert shard.push(step, r, _grads(step, r)) == len(SHAPES)
            return shard.pull(step)

        pulled = _run_replicas(replica)
        ref.step([_grads(step, 0), _grads(step, 1)])
        for got in pulled:
            _assert_params_equal(got, ref)
        assert shard.version() == step


def test_a_stage_steps_without_waiting_for_the_other_stages_on_its_shard():
    init = _init_params()
    shard = ParameterServerShard(init, TRAIN, n_workers=2, timeout_s=10)
    ref = Reference({n: init[n] for n in STAGE0})
    for r in (0, 1):
        shard.push(1, r, _grads(1, r, STAGE0))
    ref.step([_grads(1, 0, STAGE0), _grads(1, 1, STAGE0)])
    _assert_params_equal(shard.pull(1, STAGE0, timeout_s=0.5), ref, STAGE0)
    # The other stage's parameter is untouched, and the shard as a whole is still at step 0.
    assert np.array_equal(shard.pull(0, STAGE1)["blocks.1.weight"], init["blocks.1.weight"])
    assert shard.version() == 0
    with pytest.raises(ValueError, match="mid-step"):
        shard.export_state()


def test_duplicate_and_late_pushes_count_once():
    init = _init_params()
    shard = ParameterServerShard(init, TRAIN, n_workers=2, timeout_s=10)
    ref = Reference(init)
    assert shard.push(1, 0, _grads(1, 0)) == 3
    # A retried push with other values (recomputed after a recovery): the first one stays counted.
    assert shard.push(1, 0, _grads(7, 7)) == 0
    assert shard.push(1, 1, _grads(1, 1)) == 3
    ref.step([_grads(1, 0), _grads(1, 1)])
    _assert_params_equal(shard.pull(1), ref)
    # A push of a step the shard already applied changes nothing.
    assert shard.push(1, 1, _grads(8, 8)) == 0
    _assert_params_equal(shard.pull(1), ref)


def test_pull_timeout_names_the_missing_replicas():
    shard = ParameterServerShard(_init_params(), TRAIN, n_workers=3, shard_index=4, timeout_s=10)
    shard.push(1, 0, _grads(1, 0))
    shard.push(1, 2, _grads(1, 2, STAGE0))
    with pytest.raises(TimeoutError) as e:
        shard.pull(1, timeout_s=0.2)
    msg = str(e.value)
    assert "shard 4: pull(step=1) timed out after 0.2s" in msg
    assert "2 names ('blocks.0.bias', 'blocks.0.weight') miss pushes from replicas [1] of n_workers=3" in msg
    assert "1 names ('blocks.1.weight') miss pushes from replicas [1, 2]" in msg
    with pytest.raises(TimeoutError, match=r"at step 0, steps 1\.\.3 were never pushed"):
        shard.pull(3, STAGE1, timeout_s=0.1)


def test_pull_waits_for_the_last_push():
    shard = ParameterServerShard(_init_params(), TRAIN, n_workers=2, timeout_s=30)
    shard.push(1, 0, _grads(1, 0))
    result: Future = Future()
    t = threading.Thread(target=lambda: result.set_result(shard.pull(1)))
    t.start()
    assert blocked_in_wait(t) and not result.done(), "pull returned before replica 1 pushed"
    shard.push(1, 1, _grads(1, 1))
    t.join(10)
    ref = Reference(_init_params())
    ref.step([_grads(1, 0), _grads(1, 1)])
    _assert_params_equal(result.result(timeout=1), ref)


def test_rejected_pushes_leave_nothing_counted():
    shard = ParameterServerShard(_init_params(), TRAIN, n_workers=2, timeout_s=10)
    with pytest.raises(KeyError, match="does not own 'blocks.9.weight'"):
        shard.push(1, 0, {**_grads(1, 0), "blocks.9.weight": np.zeros(1, np.float32)})
    bad = {**_grads(1, 0), "blocks.1.weight": np.zeros((3, 2), np.float32)}
    with pytest.raises(ValueError, match=r"has shape \(3, 2\), the parameter \(2, 3\)"):
        shard.push(1, 0, bad)
    with pytest.raises(ValueError, match=r"replica\(2\) is not in range\(n_workers=2\)"):
        shard.push(1, 2, _grads(1, 2))
    with pytest.raises(ValueError, match="push for step 2 .* at step 0; expected step 1"):
        shard.push(2, 0, _grads(2, 0))
    assert shard.reset_pending() == 0


def test_reset_pending_drops_an_abandoned_step_and_takes_a_new_dp():
    init = _init_params()
    shard = ParameterServerShard(init, TRAIN, n_workers=2, timeout_s=10)
    shard.push(1, 0, _grads(9, 9))
    assert shard.reset_pending(n_workers=3) == 3
    ref = Reference(init)
    for r in range(3):
        shard.push(1, r, _grads(1, r))
    ref.step([_grads(1, r) for r in range(3)])
    _assert_params_equal(shard.pull(1), ref)
    with pytest.raises(ValueError, match=r"n_workers\(0\)"):
        shard.reset_pending(0)


def test_export_matches_a_worker_export_and_load_round_trips():
    init = _init_params()
    shard = ParameterServerShard(init, TRAIN, n_workers=2, shard_index=1, timeout_s=10)
    ref = Reference(init)
    for step in (1, 2):
        for r in (0, 1):
            shard.push(step, r, _grads(step, r))
        ref.step([_grads(step, 0), _grads(step, 1)])
    state = shard.export_state(step=2)
    worker = export_shard(2, ref.params.items(), ref.opt, [0, 1])
    assert state["step"] == 2 and state["blocks"] == [0, 1]
    assert state["extra"] == {"ps_shard": 1, "ps_n_workers": 2}
    for n in SHAPES:
        assert np.array_equal(state["params"][n], worker["params"][n])
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert np.array_equal(state["optim"][n][k], worker["optim"][n][k]), (n, k)

    # A shard started elsewhere, loaded from the export, continues exactly like the original.
    other = ParameterServerShard(_init_params(seed=5), TRAIN, n_workers=2, timeout_s=10)
    other.push(1, 0, _grads(1, 0))  # a stale partial step, dropped by the load
    assert other.load_state(state) == 2 and other.version() == 2
    for s in (shard, other):
        for r in (0, 1):
            s.push(3, r, _grads(3, r))
    ref.step([_grads(3, 0), _grads(3, 1)])
    _assert_params_equal(shard.pull(3), ref)
    _assert_params_equal(other.pull(3), ref)
    with pytest.raises(ValueError, match="already at step 3; load_state the shard to go back"):
        other.export_state(step=2)


def test_load_state_names_missing_parameters():
    shard = ParameterServerShard(_init_params(), TRAIN, n_workers=1, timeout_s=10)
    partial = ParameterServerShard(_init_params(), TRAIN, n_workers=1, names=STAGE0).export_state()
    with pytest.raises(ValueError, match="missing from the shards given, e.g. \\['blocks.1.weight'\\]"):
        shard.load_state(partial)


# -- the client, over handles that call the shard on threads as an actor would --------------
class _Method:
    def __init__(self, pool, fn):
        self.pool, self.fn = pool, fn

    def remote(self, *args):
        return self.pool.submit(self.fn, *args)


class _Handle:
    def __init__(self, shard, pool):
        self.push = _Method(pool, shard.push)
        self.pull = _Method(pool, shard.pull)


def _get(futures, timeout):
    return [f.result(timeout=timeout) for f in futures]


def test_client_push_pull_over_two_shards_counts_bytes():
    init = _init_params()
    assignment = assign_shards({n: int(np.prod(s)) for n, s in SHAPES.items()}, 2)
    assert set(assignment.values()) == {0, 1}
    shards = [ParameterServerShard(init, TRAIN, n_workers=2, names=[n for n in SHAPES if assignment[n] == i],
                                   shard_index=i, timeout_s=10) for i in range(2)]
    ref = Reference(init)
    with ThreadPoolExecutor(8) as pool:
        handles = [_Handle(s, pool) for s in shards]
        models = [{n: torch.nn.Parameter(torch.tensor(a)) for n, a in init.items()} for _ in range(2)]
        clients = [PSClient(m.items(), handles, assignment, r, 2, timeout_s=10, get=_get) for r, m in enumerate(models)]
        stats = [CommStats(), CommStats()]
        for step in (1, 2):
            for r, m in enumerate(models):
                for n, p in m.items():
                    p.grad = torch.tensor(_grads(step, r)[n])
            _run_replicas(lambda r: clients[r].push_pull(step, stats[r]))
            ref.step([_grads(step, 0), _grads(step, 1)])
            for m in models:
                _assert_params_equal({n: p.detach().numpy() for n, p in m.items()}, ref)
    nbytes = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
    for s in stats:
        assert s.by_op == {"ps_push": 2 * nbytes, "ps_pull": 2 * nbytes}
        assert s.bytes == 4 * nbytes and s.calls == 4


def test_client_rejects_names_without_a_shard():
    params = {"blocks.0.weight": torch.zeros(2), "blocks.3.bias": torch.zeros(2)}
    with pytest.raises(ValueError, match="no shard assigned to 'blocks.3.bias'"):
        PSClient(params, [object()], {"blocks.0.weight": 0}, 0, 1)
    with pytest.raises(ValueError, match=r"names shards \[1\] but 1 handles were given"):
        PSClient(params, [object()], {"blocks.0.weight": 0, "blocks.3.bias": 1}, 0, 1)
    with pytest.raises(ValueError, match=r"replica\(2\) is not in range\(n_replicas=2\)"):
        PSClient(params, [object()], {"blocks.0.weight": 0, "blocks.3.bias": 0}, 2, 2)


def test_dropping_pending_pushes_ends_a_waiting_pull_at_once():
    shard = ParameterServerShard({"blocks.0.w": np.zeros(3, np.float32)}, {"lr": 0.1}, n_workers=2, timeout_s=30)
    shard.push(1, 0, {"blocks.0.w": np.ones(3, np.float32)})
    errors = []

    def pull():
        try:
            shard.pull(1)
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=pull)
    t.start()
    assert blocked_in_wait(t)   # the pull waits on the pushes of step 1
    shard.reset_pending()
    # It ends on the reset, not at its 30 s timeout (which would raise TimeoutError, not this).
    t.join(20)
    assert not t.is_alive() and errors and "abandoned" in errors[0], errors
