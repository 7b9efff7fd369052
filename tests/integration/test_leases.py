"""Leases: workers run several steps on their own per controller call, exactly as step by step."""

import threading
import time

import pytest
import ray

from elastic_trainer import Trainer, TrainerConfig
from elastic_trainer.models.factory import block_param_counts
from elastic_trainer.naming import NAMESPACE

from ..conftest import tiny_config
from ..helpers import reference_losses
from .test_recovery import Chaos, assert_contiguous_data, node_of_rank

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _cfg(corpus, name, lease, steps=24, **sections):
    # ``lease`` None: control.lease_steps left at its default (auto).
    control = {} if lease is None else {"lease_steps": lease}
    return TrainerConfig.from_dict(tiny_config(
        corpus, parallel={"dp": 2, "pp": 2}, run={"name": name}, train={"steps": steps},
        checkpoint={"memory_every": 8}, control=control, **sections))


@pytest.fixture(scope="module")
def by_step(cluster, corpus_dir):
    """The step-by-step run the leased runs must equal. Balancing off: on this loaded host it
    may move a micro-batch in one run and not the other, which changes the order of the
    gradient's sums whatever drives the steps."""
    return Trainer(_cfg(corpus_dir, "steps", 1, balance={"mode": "off"}), verbose=False).fit()


def test_leases_train_exactly_as_step_by_step_with_fewer_calls(cluster, corpus_dir, by_step):
    leased = Trainer(_cfg(corpus_dir, "leases", 16, balance={"mode": "off"}), verbose=False).fit()
    assert [r["step"] for r in leased.history] == list(range(1, 25))
    # The same computation in the same order: bit for bit the same losses and data.
    assert [r["loss"] for r in leased.history] == [r["loss"] for r in by_step.history]
    assert [r["cursor"] for r in leased.history] == [r["cursor"] for r in by_step.history]
    # Three warm-up steps one at a time, then a lease up to each snapshot step (8, 16, 24): one
    # call per rank per lease, and one snapshot part per stage (104 calls step by step, 30 here).
    # Each lease was issued before the last one's steps were recorded (so the workers ran on
    # while the controller recorded them): step 8's count already holds the next lease's calls.
    calls = {r["step"]: r["actor_calls"] for r in leased.history}
    assert calls[8] - calls[3] == 2 * (4 + 2) and calls[24] == calls[16]
    assert by_step.history[-1]["actor_calls"] > 2 * leased.history[-1]["actor_calls"]
    assert [r["step"] for r in leased.history if r["snapshot"]] == [8, 16, 24]
    # Each lease's cost beyond the ranks' own calls is spread over its steps.
    assert all(r["controller_s"] >= 0 for r in leased.history)


def test_auto_leases_are_the_default_and_train_exactly_as_step_by_step(cluster, corpus_dir, by_step):
    cfg = _cfg(corpus_dir, "auto-leases", None, balance={"mode": "off"})
    assert cfg.control.lease_steps == "auto"
    leased = Trainer(cfg, verbose=False).fit()
    assert [r["step"] for r in leased.history] == list(range(1, 25))
    assert [r["loss"] for r in leased.history] == [r["loss"] for r in by_step.history]
    assert [r["cursor"] for r in leased.history] == [r["cursor"] for r in by_step.history]
    assert [r["step"] for r in leased.history if r["snapshot"]] == [8, 16, 24]
    # Leases ran: step by step costs a train_step per rank per step (96 and the snapshot parts);
    # the tiny model's steps take milliseconds, so a lease runs up to each snapshot step.
    assert by_step.history[-1]["actor_calls"] >= 24 * 4
    assert leased.history[-1]["actor_calls"] < by_step.history[-1]["actor_calls"] / 2, \
        [r["actor_calls"] for r in leased.history]


def _slow_rank0_raising_at(step: int, run: str):
    """A chaos action: rank 0 of ``run`` computes 3x slower from now (so the fault is armed, and
    the next lease granted, well before it gets there) and raises in ``step``."""
    def fault():
        actor = ray.get_actor(f"{run}-rank0-r0s0", namespace=NAMESPACE)
        ray.get(actor.inject_fault.remote("slow_compute", seconds=3.0))
        ray.get(actor.inject_fault.remote("raise", step=step))
    return fault


def test_a_failure_inside_an_auto_lease_rolls_back_as_step_by_step(cluster, corpus_dir):
    # Leases 4..8, 9..16, 17..24 after the warm-up, their length the default's (auto). Rank 0
    # raises in step 15: back to the snapshot of step 8, steps 9..15 redone, as step by step.
    cfg = _cfg(corpus_dir, "auto-fail", None, failure={"allow_fault_injection": True}, balance={"mode": "off"})

    result = Trainer(cfg, verbose=False, on_step=Chaos().at(1, _slow_rank0_raising_at(15, "auto-fail"))).fit()
    assert_contiguous_data(result, cfg)
    assert [f["failure"] for f in result.failures] == ["exception"]
    [rec] = result.recoveries
    assert (rec["failed_step"], rec["restored_step"], rec["steps_redone"]) == (15, 8, 7), rec
    # Steps 4..8 ran as a lease (step by step: a train_step per rank each, 20 calls), and the
    # steps after it too: the failure came inside one.
    calls = {r["step"]: r["actor_calls"] for r in result.history if r["plan"] == 0}
    assert calls[8] - calls[3] < 5 * 4, calls
    ref = reference_losses(cfg, cfg.train.steps)
    assert [r["loss"] for r in result.history] == pytest.approx(ref, rel=1e-5)


def test_a_failure_with_the_next_lease_queued_drops_it_and_rolls_back(cluster, corpus_dir):
    # Leases 4..8, 9..16, 17..24 after the warm-up; each granted while the one before it runs
    # (control.renew_early). Rank 0 raises in step 15: the lease 17..24 already waits behind 9..16
    # on every rank, where it must not run (refused where 9..16 failed, cut where it blocked).
    cfg = _cfg(corpus_dir, "lease-queued", 8, failure={"allow_fault_injection": True})

    # Slower steps: the controller grants 17..24 well before rank 0 reaches step 15.
    result = Trainer(cfg, verbose=False, on_step=Chaos().at(1, _slow_rank0_raising_at(15, "lease-queued"))).fit()
    assert_contiguous_data(result, cfg)
    assert [f["failure"] for f in result.failures] == ["exception"]
    [rec] = result.recoveries
    assert (rec["failed_step"], rec["restored_step"], rec["steps_redone"]) == (15, 8, 7), rec
    assert rec["leases_dropped"] == [[17, 24]], rec
    ref = reference_losses(cfg, cfg.train.steps)
    assert [r["loss"] for r in result.history] == pytest.approx(ref, rel=1e-5)


def test_a_failure_in_a_lease_stops_every_rank_and_rolls_back_as_step_by_step(fresh_cluster, corpus_dir):
    c, nodes = fresh_cluster(4)
    cfg = TrainerConfig.from_dict(tiny_config(
        corpus_dir, parallel={"dp": 2, "pp": 2}, run={"name": "lease-loss"}, train={"steps": 48},
        checkpoint={"memory_every": 24}, control={"lease_steps": 24},
        balance={"mode": "off"},
        failure={"min_step_timeout_s": 3, "rendezvous_timeout_s": 10, "wait_for_nodes_s": 2,
                 "allow_fault_injection": True}))

    def slow():
        # Rank 0 computes 10x slower (a sleep: the numbers stay), so the lease of steps 25 .. 48
        # takes seconds, and the node killed once every rank has done step 25 dies inside it.
        actor = ray.get_actor("lease-loss-rank0-r0s0", namespace=NAMESPACE)
        ray.get(actor.inject_fault.remote("slow_compute", seconds=10.0))

    def kill_inside_the_lease():
        # Waits on the event itself: every rank has completed step 25 (inside the lease, which
        # began as step 24 ended), as each worker says; then rank 3's node goes.
        node = node_of_rank("lease-loss", 3, nodes)
        actors = [ray.get_actor(f"lease-loss-rank{r}-r{r // 2}s{r % 2}", namespace=NAMESPACE) for r in range(4)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and min(ray.get([a.last_step.remote() for a in actors])) < 25:
            time.sleep(0.02)
        c.remove_node(node, allow_graceful=False)

    def kill_soon():
        threading.Thread(target=kill_inside_the_lease, daemon=True).start()

    result = Trainer(cfg, verbose=False, on_step=Chaos().at(1, slow).at(24, kill_soon)).fit()
    assert_contiguous_data(result, cfg)
    [rec] = result.recoveries
    # A killed node is a death, or silent where the heartbeat finds it before its peers' errors
    # (the full suite once read it silent: the lease's ranks wait on slowed rank 0, not on it).
    assert [f["failure"] for f in result.failures] in (["death"], ["silent"])
    # As step by step: back to the last snapshot before the failed step, every step since redone
    # (steps of the lease done before it are redone too: no snapshot was taken in between).
    assert rec["restored_step"] == 24 and 26 <= rec["failed_step"] <= 48, rec
    assert rec["steps_redone"] == rec["failed_step"] - 24
    assert rec["sources"] == {"live": len(block_param_counts(cfg.model))}
    ref = reference_losses(cfg, cfg.train.steps)
    got = [r["loss"] for r in result.history]
    assert got[:24] == pytest.approx(ref[:24], rel=1e-4)
    assert got[24:34] == pytest.approx(ref[24:34], rel=1e-3)

