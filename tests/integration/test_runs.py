"""Whole runs on the simulated cluster: placement, user models, the CLI, and errors."""

import statistics
import time

import pytest
import ray

from elastic_trainer import PlacementError, Trainer, TrainerConfig
from elastic_trainer.cli import main

from ..conftest import tiny_config
from .conftest import NUM_NODES

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
def test_default_cpu_placement_is_one_worker_per_node(cluster, corpus_dir):
    cfg = TrainerConfig.from_dict(tiny_config(corpus_dir, parallel={"dp": 2, "pp": 2}, run={"name": "place"}))
    seen = []

    def names_during_run(rec):
        if rec["step"] == 1:
            seen.extend(a["name"] for a in ray.util.list_named_actors(all_namespaces=True))

    result = Trainer(cfg, verbose=False, on_step=names_during_run).fit()
    assert "place-controller" in seen
    assert {"place-rank0-r0s0", "place-rank1-r0s1", "place-rank2-r1s0", "place-rank3-r1s1"} <= set(seen)
    nodes = result.plan["rank_nodes"]
    assert len(set(nodes.values())) == 4
    assert sorted(w["rank"] for w in result.workers) == [0, 1, 2, 3]
    assert len(result.plans) == 1 and {r["plan"] for r in result.history} == {0}
    assert len({w["pid"] for w in result.workers}) == 4
    # The controller counts what driving the run costs: a train_step per rank each step, a
    # snapshot part per stage on a snapshot step (dp=2 on 4 nodes: every part has copies, no pins).
    calls = [r["actor_calls"] for r in result.history]
    per_step = [b - a for a, b in zip(calls, calls[1:])]
    snap = [r["snapshot"] for r in result.history[1:]]
    assert per_step == [4 + (2 if s else 0) for s in snap], (per_step, snap)
    # Actors were named after the run and rank, and are gone after the run.
    time.sleep(1)
    assert not any(a["name"].startswith("place-") for a in ray.util.list_named_actors(all_namespaces=True))


def actor_log_lines(marker: str, wait_s: float = 10.0) -> list[str]:
    """Lines of the cluster's actor logs (what Ray writes of each actor's stderr) that contain ``marker``."""
    from pathlib import Path

    logs = Path(ray._private.worker.global_worker.node.get_session_dir_path()) / "logs"
    deadline = time.monotonic() + wait_s
    while True:
        lines = [line for f in logs.glob("worker-*.err") for line in f.read_text(errors="replace").splitlines()
                 if marker in line]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.5)


@pytest.mark.timeout(180)
def test_controller_and_workers_log_through_logging_with_the_run_name(cluster, corpus_dir):
    cfg = TrainerConfig.from_dict(tiny_config(corpus_dir, parallel={"dp": 2, "pp": 1}, run={"name": "logged"},
                                              train={"steps": 3}))
    Trainer(cfg, verbose=False).fit()
    lines = actor_log_lines("[logged]")
    text = "\n".join(lines)
    for expected in ("elastic_trainer.controller.controller: [logged] PLACING -> STARTING",
                     "elastic_trainer.controller.controller: [logged] RUNNING -> FINISHED",
                     "elastic_trainer.controller.workers: [logged] worker 0 joined",
                     "elastic_trainer.worker.actor: [logged] worker 1: rank 1 of dp=2 x pp=1"):
        assert expected in text, f"{expected!r} not in the actor logs:\n{text[-2000:]}"
    # Every record of the package, of this run or another, names its run.
    import re

    records = [line for line in actor_log_lines("") if re.search(r" (INFO|WARNING|ERROR) elastic_trainer\.", line)]
    assert records and all(re.search(r" elastic_trainer\.[\w.]+: \[[^\]]+\] ", line) for line in records)


@pytest.mark.timeout(180)
def test_pack_places_a_stage_replicas_together(cluster, corpus_dir):
    cfg = TrainerConfig.from_dict(tiny_config(
        corpus_dir, parallel={"dp": 2, "pp": 1},
        scaling={"workers_per_node": 2, "replica_placement": "pack", "placement_timeout_s": 60,
                 "resources_per_worker": {"CPU": 0.5}}))
    result = Trainer(cfg, verbose=False).fit()
    nodes = result.plan["rank_nodes"]
    assert nodes[0] == nodes[1]


@pytest.mark.timeout(180)
def test_user_factory_model_trains_through_a_pipeline(cluster, corpus_dir):
    cfg = TrainerConfig.from_dict(tiny_config(
        corpus_dir, model={"kind": "factory", "factory": "tests.helpers:build_mlp", "kwargs": {"width": 16}},
        parallel={"dp": 1, "pp": 2}, train={"steps": 20, "lr": 1e-2}))
    result = Trainer(cfg, verbose=False).fit()
    assert len(result.history) == 20
    assert result.history[-1]["loss"] < result.history[0]["loss"]


def test_a_factory_module_that_reads_a_tensor_at_import_trains(cluster, corpus_dir):
    # The module makes and reads a tensor when imported, and its build reads what it made:
    # both fail under the meta device that sizes the model, so it is imported and built outside it.
    cfg = TrainerConfig.from_dict(tiny_config(
        corpus_dir, run={"name": "importtensor"},
        model={"kind": "factory", "factory": "tests.factory_import_tensor:build", "kwargs": {"width": 16}},
        parallel={"dp": 1, "pp": 2}, train={"steps": 12, "lr": 1e-2}))
    result = Trainer(cfg, verbose=False).fit()
    assert len(result.history) == 12
    assert result.history[-1]["loss"] < result.history[0]["loss"]


@pytest.mark.timeout(120)
def test_fewer_nodes_than_workers_fails_after_a_bounded_wait(cluster, corpus_dir):
    n = NUM_NODES + 1
    cfg = TrainerConfig.from_dict(tiny_config(
        corpus_dir, parallel={"dp": n}, train={"global_batch_size": n, "micro_batch_size": 1},
        scaling={"placement_timeout_s": 3}))
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=rf"could not place {n} workers .* room for {NUM_NODES} on the cluster's {NUM_NODES + 1} alive nodes"):
        Trainer(cfg, verbose=False).fit()
    assert time.monotonic() - t0 < 60
    # Nothing is left holding the cluster's resources.
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < NUM_NODES and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == NUM_NODES


@pytest.mark.timeout(180)
def test_cli_run_with_overrides(cluster, corpus_dir, tmp_path, capsys):
    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(tiny_config(corpus_dir)))
    rc = main(["run", str(job), "--set", "train.steps=3", "--set", "parallel.pp=2", "--set", "run.log_every=1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "step     3/3" in out and "dp=1 pp=2" in out and "tok/s" in out


@pytest.mark.timeout(300)
def test_demo_job_loss_falls_by_a_third(cluster):
    """The shipped demo (real stdlib corpus, dp=2 x pp=2), cut short: the loss falls clearly."""
    cfg = TrainerConfig.from_yaml("jobs/demo.yaml", ["train.steps=60", "run.name=demo-short", "run.report_dir=null"])
    result = Trainer(cfg, verbose=False).fit()
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    assert last <= 0.7 * first, (first, last)
    assert {(r["dp"], r["pp"]) for r in result.history} == {(2, 2)}


@pytest.mark.timeout(180)
def test_cli_joins_the_cluster_named_by_ray_address(cluster, corpus_dir, tmp_path):
    import os
    import subprocess
    import sys

    import yaml

    c, _ = cluster
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(tiny_config(corpus_dir)))
    env = {**os.environ, "RAY_ADDRESS": c.address}
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_trainer", "run", str(job), "--set", "train.steps=2",
         "--set", "parallel.dp=2", "--set", "run.log_every=1"],
        env=env, capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step     2/2" in proc.stdout
    # It joined the existing cluster rather than starting its own.
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout


def _slow(run: str, rank: int, replica: int, stage: int, factor: float, step: int | None = None):
    from elastic_trainer.naming import NAMESPACE

    def go():
        actor = ray.get_actor(f"{run}-rank{rank}-r{replica}s{stage}", namespace=NAMESPACE)
        ray.get(actor.inject_fault.remote("slow_compute", step=step, seconds=factor))
    return go


def _at_steps(actions: dict):
    def on_step(rec):
        for step in [s for s in actions if s <= rec["step"]]:
            actions.pop(step)()
    return on_step


@pytest.mark.timeout(180)
def test_a_slowed_rank_is_named_rebalanced_around_and_back_with_the_curve_unchanged(cluster, corpus_dir):
    from ..helpers import reference_losses

    cfg = TrainerConfig.from_dict(tiny_config(
        corpus_dir, parallel={"dp": 2, "pp": 1}, run={"name": "slow"}, train={"steps": 64},
        # Two workers at least: the tiny model runs about as fast on one, so where the shares
        # lag the slowdown a spare can repay instead (seen: benched at step 19, no recovery event).
        balance={"window": 6}, scaling={"min_workers": 2}, failure={"allow_fault_injection": True}))
    # Rank 1 three times slower from step 3 to 24; a blip of rank 0 at step 50 alone (set
    # worker-side ahead of time: the driver sees steps late, so a blip it started and ended by
    # hand could cover no step, or several).
    result = Trainer(cfg, verbose=False, on_step=_at_steps({
        3: _slow("slow", 1, 1, 0, 3.0), 4: _slow("slow", 0, 0, 0, 10.0, step=50),
        24: _slow("slow", 1, 1, 0, 1.0)})).fit()
    kinds = lambda k: [e for e in result.events if e["kind"] == k]  # noqa: E731
    slow_ev, back, every_move = kinds("straggler"), kinds("straggler_recovered"), kinds("rebalance")
    # The injected slowdown is named first, and recovers. Two ranks share this host's two cores
    # with the controller and the raylets: a rank can later read 1.6x slow for a window with no
    # fault (seen), and be named and worked around again; only the injected episode is checked.
    story = "\n".join(
        [str(e) for e in result.events if e["kind"] in ("straggler", "straggler_recovered", "rebalance")]
        + [f'{r["step"]} {r.get("pace")} {r.get("shares")} {r["rank_compute_s"]}' for r in result.history])
    assert slow_ev and back, story
    assert slow_ev[0]["rank"] == 1 and back[0]["rank"] == 1 and slow_ev[0]["since_step"] < 24
    # The one-step blip of rank 0 is neither named nor acted on: it was slow at step 50 ...
    own0 = {r["step"]: r["rank_compute_s"]["0"] for r in result.history}
    # (rank 0's compute swings 2x between steps on a loaded host: seen 0.037 s at step 49 and
    # 0.074 s at 51 around a blip of 0.218 s)
    around = [own0[s] for s in range(44, 57) if s != 50]
    assert own0[50] > 3 * statistics.median(around) and own0[50] > 1.5 * max(own0[49], own0[51]), story
    named0 = [e for e in slow_ev if e["rank"] == 0]
    assert not [e for e in named0 if e["since_step"] >= 48]
    # ... and a move for rank 0 from then on can only be for a naming before it (seen in CI: the
    # host read rank 0 slow with no fault, and the shares moved at step 50, before the blip).
    for m in every_move:
        if m["step"] >= 50 and 0 in (m.get("ranks") or []):
            assert [e for e in named0 if e["step"] <= m["step"] and e["since_step"] < 48], m
    moves = [m for m in every_move if m["step"] <= back[0]["step"]]
    # Named within the window of the slowdown's start (the driver sees steps up to ~0.5 s late).
    assert slow_ev[0]["step"] - slow_ev[0]["since_step"] < cfg.balance.window
    # Its figures are the slowdown's, read since its onset. Beside a peer that shares the two
    # cores, and whose own compute then swings 3x from step to step, the 3x slowdown reads
    # 1.6-3.6x a step on a loaded host, 1.8x over a window (seen in CI): clearly slow, not 3x.
    assert slow_ev[0]["compute_s"] > 1.5 * slow_ev[0]["reference_s"] and slow_ev[0]["worker"] is not None, story
    assert back[0]["step"] > slow_ev[0]["step"]
    # Micro-batches move off the slow replica once it is named, and back once it recovers; the blip moves none.
    assert moves[0]["step"] == slow_ev[0]["step"] and moves[0]["shares"][1] < moves[0]["shares"][0]
    assert moves[0]["predicted_step_s"] < moves[0]["step_s_before"]
    # Back to equal shares by the time it has recovered (on a shared CPU host a rank on fewer
    # micro-batches reads a little slow per micro-batch, so the way back may go by nearer shares).
    assert moves[-1]["shares"] is None and moves[-1]["step"] <= back[0]["step"]
    shared = [r for r in result.history if r.get("shares")]
    assert shared and all(sum(r["shares"]) == 8 for r in shared)
    assert all(set(r["rank_compute_s"]) == {"0", "1"} for r in result.history)
    # Weighted by samples, unequal shares make the equal shares' update: the curve is the balanced run's.
    assert [r["loss"] for r in result.history] == pytest.approx(reference_losses(cfg, cfg.train.steps), rel=1e-5)


@pytest.mark.timeout(180)
def test_shares_move_between_pipelined_replicas_with_the_curve_unchanged(cluster, corpus_dir):
    from ..helpers import reference_losses

    cfg = TrainerConfig.from_dict(tiny_config(
        corpus_dir, parallel={"dp": 2, "pp": 2}, run={"name": "slowpp"}, train={"steps": 24},
        balance={"window": 6}, failure={"allow_fault_injection": True}))
    result = Trainer(cfg, verbose=False, on_step=_at_steps({2: _slow("slowpp", 3, 1, 1, 3.0)})).fit()
    moves = [e for e in result.events if e["kind"] == "rebalance"]
    # (Four workers share this host's two cores: a rank whose peers wait on the slowed one runs
    # faster than its own peers, so another rank may be named too; the shares still go by replica.)
    assert 3 in [e["rank"] for e in result.events if e["kind"] == "straggler"]
    # 1F1B runs at least as many micro-batches as stages: replica 1 keeps 2 of the 8 at least.
    assert moves and moves[0]["shares"][1] < moves[0]["shares"][0]
    assert all(min(m["shares"]) >= 2 for m in moves if m.get("shares"))
    assert [r["loss"] for r in result.history] == pytest.approx(reference_losses(cfg, cfg.train.steps), rel=1e-5)


@pytest.mark.timeout(240)
def test_a_straggler_no_share_can_help_is_left_out_as_a_spare_and_let_back_in(cluster, corpus_dir):
    from ..helpers import reference_losses

    # One micro-batch per replica: no share can move, so the straggler is benched (a re-plan
    # without it, priced against two set-ups), probed while benched, and grown onto once well.
    cfg = TrainerConfig.from_dict(tiny_config(
        corpus_dir, parallel={"dp": 2, "pp": 1}, run={"name": "bench"},
        train={"steps": 110, "micro_batch_size": 4},
        balance={"window": 6, "payback_steps": 5000}, scaling={"grow_check_s": 0.5},
        failure={"allow_fault_injection": True}))
    # 20x: the tiny model's compute is a small part of its step, so at 5x the step grew a few
    # percent and leaving the rank out repaid by a hair or not at all (seen: 63.8 against 63.4 ms).
    slow = _slow("bench", 1, 1, 0, 20.0)
    well = _slow("bench", 1, 1, 0, 1.0)
    state = {"benched_at": None}

    def on_step(rec, actions={3: slow}):
        _at_steps(actions)(rec)
        if rec["dp"] == 1 and state["benched_at"] is None:
            state["benched_at"] = rec["step"]
            actions[rec["step"] + 10] = well

    result = Trainer(cfg, verbose=False, on_step=on_step).fit()
    moves = [e for e in result.events if e["kind"] == "rebalance"]
    spare = [m for m in moves if m["action"] == "spare"]
    back = [m for m in moves if m["action"] == "readmit"]
    assert spare and spare[0]["rank"] == 1 and spare[0]["plan_after"] == {"dp": 1, "pp": 1}
    assert spare[0]["predicted_step_s"] < spare[0]["step_s_before"]
    assert back and back[0]["step"] > spare[0]["step"] and back[0]["reason"] == "its probe is faster"
    assert back[0]["probe_s"] * 3 < back[0]["probe_s_benched"]   # it was 20x slower when benched
    # Left out by a re-plan, grown onto again; no re-plan redoes a step. (On this shared host a
    # rank may later read slow for long enough to be benched once more.)
    reasons = [r["reason"] for r in result.recoveries]
    assert reasons[0] == "straggler" and "grow" in reasons, reasons
    assert all(r["steps_redone"] == 0 for r in result.recoveries)
    plans = [(p["dp"], p["pp"]) for p in result.plans]
    assert plans[:3] == [(2, 1), (1, 1), (2, 1)], plans
    assert [r["loss"] for r in result.history] == pytest.approx(reference_losses(cfg, cfg.train.steps), rel=1e-5)


@pytest.mark.timeout(240)
def test_a_slow_stage_of_a_pipeline_is_recut_and_cut_back_with_the_curve_unchanged(cluster, corpus_dir):
    from ..helpers import reference_losses

    # One replica: no share can move, so the slow rank's stage is given fewer blocks by a live
    # re-plan (each rank on its worker), and the balanced cut comes back once it recovers. Two
    # workers at least: the tiny model runs faster on one, which would make a spare repay. The
    # slowdown starts after the first window, which is a lone pipeline's yardstick.
    cfg = TrainerConfig.from_dict(tiny_config(
        corpus_dir, parallel={"dp": 1, "pp": 2}, run={"name": "recut"}, train={"steps": 90},
        # A threshold of 0.3 names a rank past 1.3x and re-cuts past 1.6x: this host's noise makes
        # a rank read 1.3x against its own start for a window (seen), the injected straggler 3x.
        balance={"window": 6, "payback_steps": 500, "threshold": 0.3}, scaling={"min_workers": 2},
        failure={"allow_fault_injection": True}))
    state = {"recut_at": None}
    actions = {9: _slow("recut", 1, 0, 1, 3.0)}

    def on_step(rec):
        _at_steps(actions)(rec)
        if state["recut_at"] is None and rec["plan"] > 0:
            state["recut_at"] = rec["step"]
            actions[rec["step"] + 10] = _slow("recut", 1, 0, 1, 1.0)

    result = Trainer(cfg, verbose=False, on_step=on_step).fit()
    moves = [e for e in result.events if e["kind"] == "rebalance"]
    assert 1 in [e["rank"] for e in result.events if e["kind"] == "straggler"]
    recut = [m for m in moves if m["action"] == "recut"]
    back = [m for m in moves if m["action"] == "balanced cut"]
    assert recut and recut[0]["ranks"] == [1] and recut[0]["predicted_step_s"] < recut[0]["step_s_before"]
    first, cut = result.plans[0]["stages"], recut[0]["stages"]
    # The slow stage holds fewer blocks, the other more; every block is held once.
    assert cut[1][1] - cut[1][0] < first[1]["blocks"][1] - first[1]["blocks"][0] and cut[0][0] == 0
    assert back and back[0]["step"] > recut[0]["step"] and back[0]["stages"] == [s["blocks"] for s in first]
    # Live re-plans after a snapshot step: nothing redone, the same workers, back to the first cut.
    reasons = [r["reason"] for r in result.recoveries]
    assert reasons[:2] == ["recut", "recut"], reasons
    assert all(r["steps_redone"] == 0 and r["plan_after"]["dp"] == 1 for r in result.recoveries)
    # Each rank stays on its worker: its three groups (two one-rank DP groups, the pipeline) are carried.
    assert all((r["groups_carried"], r["groups_built"]) == (3, 0) for r in result.recoveries[:2]), result.recoveries
    assert [p["stages"][1]["blocks"] for p in result.plans[:3]] == [first[1]["blocks"], cut[1], first[1]["blocks"]]
    assert len({tuple(sorted(p["workers"].values())) for p in result.plans}) == 1
    # The cut moves where blocks run, not what they compute: the curve is the balanced run's.
    assert [r["loss"] for r in result.history] == pytest.approx(reference_losses(cfg, cfg.train.steps), rel=1e-5)
