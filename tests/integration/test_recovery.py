"""Chaos on a simulated cluster: nodes SIGKILLed (remove_node), hung workers, exceptions, growth, resume."""

import os
import signal
import threading
import time

import pytest
import ray

from elastic_trainer import Trainer, TrainerConfig
from elastic_trainer.controller.controller import RunError
from elastic_trainer.planning.policy import choose_plan
from elastic_trainer.models.factory import block_param_counts
from elastic_trainer.naming import NAMESPACE
from elastic_trainer.chaos.simulate import freeze_node, kill_pids

from ..conftest import tiny_config
from ..helpers import reference_losses
from .conftest import add_node
from .test_runs import actor_log_lines

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# Chaos tests inject faults: the run must allow it (off by default).
FAST_FAILURE = {"startup_timeout_s": 30, "min_step_timeout_s": 3, "rendezvous_timeout_s": 10,
                "wait_for_nodes_s": 2, "allow_fault_injection": True}


def config(corpus, name, steps=24, **sections):
    sections.setdefault("failure", {})
    sections["failure"] = {**FAST_FAILURE, **sections["failure"]}
    sections.setdefault("comm", {"timeout_s": 20})
    # These tests pin down what a recovery redoes, so a snapshot every step (auto spaces them out:
    # tests/integration/test_snapshot_budget.py).
    sections["checkpoint"] = {"memory_every": 1, **sections.get("checkpoint", {})}
    run = {"name": name, **sections.pop("run", {})}
    train = {"steps": steps, **sections.pop("train", {})}
    return TrainerConfig.from_dict(tiny_config(corpus, run=run, train=train, **sections))


def status(name):
    return ray.get(ray.get_actor(f"{name}-controller", namespace=NAMESPACE).status.remote())


def node_of_rank(name, rank, nodes):
    st = status(name)
    node_id = next(w["node_id"] for w in st["workers"] if w["rank"] == rank)
    return next(n for n in nodes if n.node_id == node_id)


class Chaos:
    """Runs actions from the driver's on_step callback (steps are seen up to ~0.5 s late)."""

    def __init__(self):
        self.actions: dict[int, list] = {}
        self.done: list[int] = []

    def at(self, step, fn):
        self.actions.setdefault(step, []).append(fn)
        return self

    def __call__(self, rec):
        for step in sorted(self.actions):
            if step <= rec["step"] and step not in self.done:
                self.done.append(step)
                for fn in self.actions[step]:
                    fn()


def assert_contiguous_data(result, cfg, last: int | None = None):
    """Every step up to ``last`` (default ``train.steps``) once, each reading the batch after the last."""
    # Each step judged and the replicas checked (integrity's defaults) through whatever the run
    # lived through: no false alarm.
    assert not result.anomalies and not result.corruptions, ([dict(e) for e in result.anomalies],
                                                             [dict(e) for e in result.corruptions])
    steps = [r["step"] for r in result.history]
    assert steps == list(range(1, (last or cfg.train.steps) + 1))
    gb = cfg.train.global_batch_size
    # Every step read the batch right after the previous one: nothing skipped or read twice.
    assert [r["cursor"] for r in result.history] == [(s - 1) * gb for s in steps]


def pids(result):
    return {w["worker_id"]: w["pid"] for w in result.workers}


def test_node_loss_at_2x2_replans_survivors_and_follows_the_loss_curve(fresh_cluster, corpus_dir, tmp_path):
    c, nodes = fresh_cluster(4)
    cfg = config(corpus_dir, "loss1", parallel={"dp": 2, "pp": 2}).with_overrides([f"run.report_dir={tmp_path}"])
    before = {}

    def kill():
        before.update({w["worker_id"]: w["pid"] for w in status("loss1")["workers"]})
        c.remove_node(node_of_rank("loss1", 3, nodes), allow_graceful=False)

    result = Trainer(cfg, verbose=False, on_step=Chaos().at(4, kill)).fit()

    assert_contiguous_data(result, cfg)
    [rec] = result.recoveries
    # The killed worker ends with its raylet and its peers' connections fail; where they waited
    # on something else at that moment, the heartbeat finds it silent a second later.
    assert [f["failure"] for f in result.failures] in (["death"], ["silent"])
    assert rec["steps_redone"] <= 1
    assert rec["sources"] == {"live": len(block_param_counts(cfg.model))}
    expected = choose_plan(cfg, 3)
    # 2 x 2 -> 2 x 1: the survivors keep the blocks they held and build only those they gain,
    # fetched from the live copies of the others.
    n_blocks = len(block_param_counts(cfg.model))
    assert rec["blocks_reused"] > 0 and rec["blocks_built"] > 0
    assert rec["blocks_reused"] + rec["blocks_built"] == expected.dp * n_blocks
    assert rec["restore_bytes"] > 0 and rec["restore_rate_bytes_s"] > 0
    assert (rec["plan_after"]["dp"], rec["plan_after"]["pp"]) == (expected.dp, expected.pp)
    # Survivors kept their processes.
    after = pids(result)
    survivors = set(before) & set(after)
    assert len(survivors) == 3 and all(before[w] == after[w] for w in survivors)
    # Losses: same as plain torch while the plan is unchanged, within 1e-3 for 10 steps after the change.
    ref = reference_losses(cfg, cfg.train.steps)
    change = rec["failed_step"]
    got = [r["loss"] for r in result.history]
    assert got[:change - 1] == pytest.approx(ref[:change - 1], rel=1e-4)
    assert got[change - 1:change + 9] == pytest.approx(ref[change - 1:change + 9], rel=1e-3)
    assert {(r["dp"], r["pp"]) for r in result.history[change - 1:]} == {(expected.dp, expected.pp)}
    # The run report is drawn, failure and recovery included.
    assert result.report_path == str(tmp_path / "loss1.png")
    assert (tmp_path / "loss1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_losses_in_a_row(fresh_cluster, corpus_dir):
    c, nodes = fresh_cluster(4)
    cfg = config(corpus_dir, "loss2", steps=30, parallel={"dp": 2, "pp": 2})
    chaos = Chaos().at(3, lambda: c.remove_node(node_of_rank("loss2", 3, nodes), allow_graceful=False))
    chaos.at(12, lambda: c.remove_node(node_of_rank("loss2", 0, nodes), allow_graceful=False))
    result = Trainer(cfg, verbose=False, on_step=chaos).fit()
    assert_contiguous_data(result, cfg)
    assert len(result.recoveries) == 2
    assert result.plans[-1]["world_size"] <= 2
    ref = reference_losses(cfg, cfg.train.steps)
    assert [r["loss"] for r in result.history] == pytest.approx(ref, rel=1e-3)


def test_loss_during_a_recovery(fresh_cluster, corpus_dir):
    c, nodes = fresh_cluster(4)
    cfg = config(corpus_dir, "loss3", parallel={"dp": 2, "pp": 2})
    victims = {}

    def first_loss():
        st = status("loss3")
        # Hold the next set-up of every survivor, so the recovery lasts long enough to be hit.
        for name in ("rank0-r0s0", "rank1-r0s1", "rank2-r1s0"):
            ray.get_actor(f"loss3-{name}", namespace=NAMESPACE).inject_fault.remote("slow_setup", seconds=2.0)
        victims["nodes"] = {w["worker_id"]: w["node_id"] for w in st["workers"]}
        # Stage 0 lives on ranks 0 and 2: either can go and stage 0 still has a live copy
        # (stage 1's other copy goes with rank 3's node now).
        victims["stage0"] = [w["worker_id"] for w in st["workers"] if w["rank"] in (0, 2)]
        c.remove_node(node_of_rank("loss3", 3, nodes), allow_graceful=False)

        def second_loss():
            # The second loss hits a worker of the plan being set up (the policy may leave a survivor spare).
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not status("loss3").get("setting_up"):
                time.sleep(0.02)
            up = status("loss3")["setting_up"] or {"workers": {}}
            victim = next((w for w in up["workers"].values() if w in victims["stage0"]), victims["stage0"][-1])
            c.remove_node(next(n for n in nodes if n.node_id == victims["nodes"][victim]), allow_graceful=False)

        threading.Thread(target=second_loss, daemon=True).start()

    result = Trainer(cfg, verbose=False, on_step=Chaos().at(4, first_loss)).fit()
    assert_contiguous_data(result, cfg)
    kinds = [f["failure"] for f in result.failures]
    # A node taken without a graceful stop shows as its actor's death or as heartbeat silence,
    # whichever reaches the controller first (on a loaded machine the heartbeat often wins).
    assert kinds[0] in ("death", "silent") and "during_recovery" in kinds, kinds
    [rec] = result.recoveries
    assert rec["attempts"] == 2
    # The abandoned attempt ends when the controller aborts it, not at the rendezvous timeout:
    # its survivors' set-ups say so in their logs (how long it took is failed_attempts_s, which
    # benchmarks/_soak.py reports for each recovery).
    failed = actor_log_lines("[loss3]", until=lambda got: any("SetupAborted" in line for line in got))
    failed = [line for line in failed if "set-up as rank" in line and " failed: " in line]
    assert any("SetupAborted: " in line and "the controller abandoned this plan" in line for line in failed), failed
    assert not [line for line in failed if "TimeoutError" in line], failed
    assert result.plans[-1]["world_size"] <= 2
    ref = reference_losses(cfg, cfg.train.steps)
    assert [r["loss"] for r in result.history] == pytest.approx(ref, rel=1e-3)


def test_loss_while_a_snapshot_is_taken_falls_back_to_the_previous_one(fresh_cluster, corpus_dir):
    c, nodes = fresh_cluster(4)
    cfg = config(corpus_dir, "snap", steps=40, parallel={"dp": 1, "pp": 4}, checkpoint={"memory_every": 10})
    seen_at = []

    def slow_pins():
        # From step 20 on, no snapshot finishes replicating: step 10's is the last committed.
        seen_at.append(status("snap")["step"])
        for r in range(4):
            for step in (20, 30, 40):
                ray.get_actor(f"snap-rank{r}-r0s{r}", namespace=NAMESPACE).inject_fault.remote("slow_pin", step=step, seconds=30)

    def kill_mid_snapshot():
        # A snapshot is being replicated (its pins are held) when rank 2's node goes.
        c.remove_node(node_of_rank("snap", 2, nodes), allow_graceful=False)

    result = Trainer(cfg, verbose=False, on_step=Chaos().at(1, slow_pins).at(20, kill_mid_snapshot)).fit()
    assert seen_at[0] < 19, f"the test's set-up came too late (step {seen_at[0]}): it proves nothing"
    assert_contiguous_data(result, cfg)
    [rec] = result.recoveries
    # The newer copies of rank 2's blocks died with its node before they were replicated:
    # every block comes from step 10's committed snapshot, none from a newer step.
    assert rec["restored_step"] == 10
    assert rec["sources"].get("snapshot", 0) > 0 and rec["parts_from_holders"] > 0
    ref = reference_losses(cfg, cfg.train.steps)
    assert [r["loss"] for r in result.history] == pytest.approx(ref, rel=1e-3)


def test_pp_only_run_loses_a_stage_and_restores_it_from_the_snapshot(fresh_cluster, corpus_dir):
    c, nodes = fresh_cluster(4)
    cfg = config(corpus_dir, "pponly", parallel={"dp": 1, "pp": 4})
    result = Trainer(cfg, verbose=False, on_step=Chaos().at(
        4, lambda: c.remove_node(node_of_rank("pponly", 1, nodes), allow_graceful=False))).fit()
    assert_contiguous_data(result, cfg)
    [rec] = result.recoveries
    assert rec["sources"].get("snapshot", 0) > 0
    # The lost stage's part is read from its holder's pinned copy, not from the dead node's object
    # (which Ray would chase until it declared the node dead, about 30 s).
    assert rec["parts_from_holders"] > 0
    # The survivors' parts are read through their writers, never through a copy on the dead node.
    assert rec["parts_relayed"] > 0
    assert rec["steps_redone"] <= 2
    ref = reference_losses(cfg, cfg.train.steps)
    assert [r["loss"] for r in result.history] == pytest.approx(ref, rel=1e-3)


def test_a_silent_worker_is_fenced_not_killed_and_rejoins_as_a_spare_when_it_answers(fresh_cluster, corpus_dir):
    # A worker process paused (SIGSTOP: a long GC pause, a host under memory pressure) answers no
    # heartbeat: lost to its step, and the run re-plans without it. It is fenced, not killed:
    # resumed once the run steps on the smaller plan, it answers, comes back as a spare, and the
    # run grows onto it again. A false suspicion costs a re-plan each way, and no process.
    # The steps are there to outlast its return: 5 steps after the grow the run is stopped.
    fresh_cluster(4)
    cfg = config(corpus_dir, "hang", steps=2000, parallel={"dp": 2, "pp": 2}, scaling={"grow_check_s": 0.5})
    stopped, resumed, grown = [], [], []

    def hang():
        pid = next(w["pid"] for w in status("hang")["workers"] if w["rank"] == 1)
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    def on_step(rec, chaos=Chaos().at(5, hang)):
        chaos(rec)
        if stopped and not resumed and rec["world_size"] < 4:   # stepping without it: wake it
            os.kill(stopped[0], signal.SIGCONT)
            resumed.append(rec["step"])
        if resumed and rec["world_size"] == 4:
            grown.append(rec["step"])
            if len(grown) == 5:
                ray.get(ray.get_actor("hang-controller", namespace=NAMESPACE).stop.remote("grown back"))

    try:
        result = Trainer(cfg, verbose=False, on_step=on_step).fit()
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert result.state == "STOPPED" and len(grown) >= 5, (result.state, resumed, grown)
    assert_contiguous_data(result, cfg, last=result.step)
    # A paused process answers no heartbeat: lost within failure.heartbeat_timeout_s of its step.
    [fail] = result.failures
    assert fail["failure"] == "silent" and fail["rank"] == 1, result.failures
    wid = fail["worker"]
    story = [e for e in result.events if e["kind"] in ("failure", "recovery", "fence")]
    back = [e for e in result.events if e["kind"] == "fence"]
    assert [(e["worker"], e["outcome"]) for e in back] == [(wid, "readmitted")], (resumed, story)
    silent, grow = result.recoveries[0], result.recoveries[-1]
    assert silent["reason"] == "silent" and silent["plan_after"]["world_size"] < 4, silent
    assert grow["reason"] == "grow" and grow["plan_after"]["world_size"] == 4, result.recoveries
    # The same process, back in the plan: never killed.
    assert stopped[0] in {w["pid"] for w in result.workers if w["rank"] is not None}, result.workers
    ref = reference_losses(cfg, len(result.history))
    assert [r["loss"] for r in result.history] == pytest.approx(ref, rel=1e-3)


@pytest.mark.parametrize("fanout", [16, 2], ids=["asked", "relayed"])
def test_a_frozen_node_is_caught_by_the_heartbeat_before_the_step_timeout(fresh_cluster, corpus_dir, fanout):
    # The whole node stops (its raylet and every worker on it, SIGSTOP): no process exits and no
    # connection closes, so only a missed heartbeat tells. Ray's own health check takes about
    # 5 s here (4 missed checks 1 s apart), the step timeout 3 s at least. With a fanout of 2 the
    # four nodes are asked through two relays, each of another pair of nodes.
    c, nodes = fresh_cluster(4)
    cfg = config(corpus_dir, f"freeze{fanout}", steps=24, parallel={"dp": 2, "pp": 2},
                 failure={"heartbeat_fanout": fanout})
    frozen: list[int] = []
    node_box = []

    def freeze():
        node = node_of_rank(f"freeze{fanout}", 3, nodes)
        frozen.extend(freeze_node(node))
        node_box.append(node)

    try:
        result = Trainer(cfg, verbose=False, on_step=Chaos().at(5, freeze)).fit()
    finally:
        kill_pids(frozen)
        for node in node_box:
            c.remove_node(node, allow_graceful=False)
    assert len(frozen) >= 2   # the raylet and the worker at least
    assert_contiguous_data(result, cfg)
    [fail] = result.failures
    assert fail["failure"] == "silent" and fail["rank"] == 3 and "heartbeat" in fail["detail"], result.failures
    [rec] = result.recoveries
    # Caught by the heartbeat (a "silent" worker that answered none), not by the step timeout
    # (a "hang"); and the survivors' collectives ended by cutting their sockets: none stayed
    # inside the failed step (that would be a "hang" failure besides). How soon it was caught
    # and how long the recovery took are benchmarks/heartbeat.py's (frozen node named after)
    # and benchmarks/recovery.py's (freeze) figures.
    assert rec["reason"] == "silent" and "answered no heartbeat" in fail["detail"], rec
    assert rec["sources"] == {"live": len(block_param_counts(cfg.model))}
    ref = reference_losses(cfg, cfg.train.steps)
    change = rec["failed_step"]
    got = [r["loss"] for r in result.history]
    assert got[:change - 1] == pytest.approx(ref[:change - 1], rel=1e-4)
    assert got[change - 1:change + 9] == pytest.approx(ref[change - 1:change + 9], rel=1e-3)


def test_exception_in_a_step_rolls_back_and_retries_with_the_same_workers(fresh_cluster, corpus_dir):
    fresh_cluster(4)
    cfg = config(corpus_dir, "exc", steps=40, parallel={"dp": 2, "pp": 2})
    before, target = {}, []

    def inject():
        st = status("exc")
        before.update({w["worker_id"]: w["pid"] for w in st["workers"]})
        target.append(st["step"] + 5)  # far enough ahead of the running step
        ray.get(ray.get_actor("exc-rank2-r1s0", namespace=NAMESPACE).inject_fault.remote("raise", step=target[0]))

    result = Trainer(cfg, verbose=False, on_step=Chaos().at(2, inject)).fit()
    assert_contiguous_data(result, cfg)
    [fail] = result.failures
    assert fail["failure"] == "exception" and fail["step"] == target[0] and "injected fault" in fail["detail"], \
        (target, result.failures)
    [rec] = result.recoveries
    assert rec["restored_step"] == target[0] - 1 and rec["plan_after"] == rec["plan_before"]
    assert pids(result) == before
    ref = reference_losses(cfg, cfg.train.steps)
    assert [r["loss"] for r in result.history] == pytest.approx(ref, rel=1e-4)


def test_too_many_failures_stop_the_run_with_a_durable_checkpoint(fresh_cluster, corpus_dir, tmp_path):
    fresh_cluster(4)
    cfg = config(corpus_dir, "maxf", steps=40, parallel={"dp": 2, "pp": 2}, failure={"max_failures": 1},
                 checkpoint={"storage": str(tmp_path / "ck")}).with_overrides([f"run.report_dir={tmp_path}"])

    def inject():
        now = status("maxf")["step"]
        for s in (now + 5, now + 9):
            ray.get(ray.get_actor("maxf-rank0-r0s0", namespace=NAMESPACE).inject_fault.remote("raise", step=s))

    with pytest.raises(RunError, match=r"stopped after 2 failures \(failure.max_failures=1\).*durable checkpoint at"):
        Trainer(cfg, verbose=False, on_step=Chaos().at(2, inject)).fit()
    assert any(p.name.startswith("step-") for p in (tmp_path / "ck").iterdir())
    # A failed run still gets its report.
    assert (tmp_path / "maxf.png").stat().st_size > 10_000


def test_a_cluster_short_at_the_start_starts_on_what_fits_and_grows_as_nodes_join(fresh_cluster, corpus_dir):
    # dp=2 x pp=2 asked for on 2 one-CPU nodes: after scaling.start_wait_s it starts on the 2
    # workers that fit (the policy's layout for them), and grows onto the 2 nodes added mid-run;
    # 10 steps after the grow it is stopped (the steps are there to outlast the new workers' start).
    c, nodes = fresh_cluster(2)
    cfg = config(corpus_dir, "grow", steps=2000, parallel={"dp": 2, "pp": 2},
                 scaling={"start_wait_s": 1, "grow_check_s": 0.5})
    added, grown = [], []

    def on_step(rec, chaos=Chaos().at(3, lambda: added.extend(add_node(c) for _ in range(2)))):
        chaos(rec)
        if rec["world_size"] == 4:
            grown.append(rec["step"])
            if len(grown) == 10:
                ray.get(ray.get_actor("grow-controller", namespace=NAMESPACE).stop.remote("grown"))

    result = Trainer(cfg, verbose=False, on_step=on_step).fit()
    assert result.state == "STOPPED" and len(grown) >= 10, (result.state, grown)
    assert_contiguous_data(result, cfg, last=result.step)
    [smaller] = [e for e in result.events if e["kind"] == "start_smaller"]
    assert smaller["room"] == 2 and smaller["plan_before"]["world_size"] == 4, smaller
    assert result.plans[0]["world_size"] == smaller["plan_after"]["world_size"] == 2, result.plans[0]
    grow = [e for e in result.recoveries if e["reason"] == "grow"]
    assert grow, [e for e in result.events if e["kind"] != "state"]
    assert result.plans[-1]["world_size"] == 4
    assert grow[0]["steps_redone"] == 0 and grow[0]["sources"] == {"live": len(block_param_counts(cfg.model))}
    change = grow[0]["failed_step"]
    ref = reference_losses(cfg, change + 9)
    got = [r["loss"] for r in result.history]
    assert got[:change - 1] == pytest.approx(ref[:change - 1], rel=1e-4)
    assert got[change - 1:change + 9] == pytest.approx(ref[change - 1:change + 9], rel=1e-3)


def test_whole_cluster_lost_then_resume_and_corrupt_checkpoint_fallback(fresh_cluster, corpus_dir, tmp_path):
    import yaml

    from elastic_trainer.cli.commands import main

    c, nodes = fresh_cluster(4)
    storage = tmp_path / "ck"
    cfg = config(corpus_dir, "whole", steps=20, parallel={"dp": 2, "pp": 2},
                 checkpoint={"storage": str(storage), "durable_every": 4})

    def lose_everything():
        for n in nodes:
            c.remove_node(n, allow_graceful=False)

    with pytest.raises(RunError, match=r"below scaling.min_workers\(1\)"):
        Trainer(cfg, verbose=False, on_step=Chaos().at(10, lose_everything)).fit()
    # Finished checkpoints only: a write in flight when the cluster went leaves a folder without
    # its manifest, which a resume reports as not finished and passes over.
    dirs = [p for p in storage.iterdir() if p.name.startswith("step-")]
    saved = sorted(int(p.name[5:13]) for p in dirs if (p / "manifest.json").exists())
    unfinished = [p.name for p in dirs if not (p / "manifest.json").exists()]
    assert saved and saved[-1] >= 8

    # Corrupt the newest finished checkpoint: resume must report it and use the one before.
    [newest] = storage.glob(f"step-{saved[-1]:08d}-*/shard-000.pt")
    newest.write_bytes(newest.read_bytes()[:-100] + b"\0" * 100)
    for _ in range(4):
        add_node(c)
    c.wait_for_nodes()
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    # The CLI's --resume path, in this process (it joins the running cluster).
    got = {}
    from elastic_trainer import trainer as trainer_mod

    orig_fit = trainer_mod.Trainer.fit

    def spy(self, *a, **k):
        got["result"] = orig_fit(self, *a, **k)
        return got["result"]

    trainer_mod.Trainer.fit = spy
    try:
        run_id = newest.parent.name.split("-")[2]
        assert main(["run", str(job), "--resume-from", run_id, "--set", "run.name=whole2"]) == 0
    finally:
        trainer_mod.Trainer.fit = orig_fit
    result = got["result"]
    problems = [e["detail"] for e in result.events if e["kind"] == "checkpoint_problem"]
    assert any("corrupt" in d and newest.parent.name in d for d in problems), problems
    for name in unfinished:
        assert any(name in d and "not finished" in d for d in problems), (name, problems)
    [resume] = [e for e in result.events if e["kind"] == "resume"]
    assert resume["step"] == saved[-2]
    assert_contiguous_data(result, cfg)
    ref = reference_losses(cfg, cfg.train.steps)
    assert [r["loss"] for r in result.history] == pytest.approx(ref, rel=1e-4)


def _loss_then_follow_the_clean_run(fresh_cluster, cfg, after_rel):
    """Run ``cfg`` once without failures and once losing rank 3's node after step 4: the
    same losses up to the step restored, within ``after_rel`` after it (the steps after the
    restored one are run again on the new plan). Returns the chaos run."""
    c, nodes = fresh_cluster(4)
    name = cfg.run.name
    clean = Trainer(cfg.with_overrides([f"run.name={name}-clean"]), verbose=False).fit()
    result = Trainer(cfg, verbose=False, on_step=Chaos().at(
        4, lambda: c.remove_node(node_of_rank(name, 3, nodes), allow_graceful=False))).fit()
    assert_contiguous_data(result, cfg)
    [rec] = result.recoveries
    # Under load the newest snapshot may not be whole when the node goes (a survivor dropped
    # for staying inside the failed step takes its copies along): the restore then takes an
    # older complete one, and the steps after it are the new plan's.
    kept = rec["restored_step"]
    assert kept < rec["failed_step"], rec
    got = [r["loss"] for r in result.history]
    want = [r["loss"] for r in clean.history]
    assert got[:kept] == pytest.approx(want[:kept], rel=1e-5)
    assert got[kept:] == pytest.approx(want[kept:], rel=after_rel)
    return result


def test_node_loss_with_compression_keeps_training_correctly(fresh_cluster, corpus_dir):
    """int8 with error feedback: the residuals are worker state that a recovery restores
    (the survivors' own copies) or resets; training carries on along the same curve
    (a new dp x pp re-splits what int8 rounds, hence a tolerance after the change)."""
    cfg = config(corpus_dir, "cmp", parallel={"dp": 2, "pp": 2}, comm={"compression": "int8", "timeout_s": 20})
    result = _loss_then_follow_the_clean_run(fresh_cluster, cfg, after_rel=0.02)
    assert all(r["compression_ratio"] > 3.5 for r in result.history if r["dp"] > 1)


def test_node_loss_in_parameter_server_mode(fresh_cluster, corpus_dir):
    """The shards (on the controller's node) outlive the lost worker node; they drop the
    half-pushed step, take the new dp and carry on from the restored step. Per-replica
    clipping depends on how the batch is split, so a new dp moves the curve a little."""
    cfg = config(corpus_dir, "psl", parallel={"dp": 2, "pp": 2}, comm={"sync": "parameter_server", "timeout_s": 20})
    _loss_then_follow_the_clean_run(fresh_cluster, cfg, after_rel=0.02)


def test_node_loss_in_diloco_mode_rolls_back_to_the_last_meeting(fresh_cluster, corpus_dir):
    """Between meetings the replicas differ: the restore point is a meeting step, where the
    snapshot holds the one agreed model and DiLoCo's outer state."""
    c, nodes = fresh_cluster(4)
    cfg = config(corpus_dir, "dil", parallel={"dp": 2, "pp": 2},
                 comm={"sync": "diloco", "local_steps": 4, "timeout_s": 20})
    result = Trainer(cfg, verbose=False, on_step=Chaos().at(
        6, lambda: c.remove_node(node_of_rank("dil", 3, nodes), allow_graceful=False))).fit()
    assert_contiguous_data(result, cfg)
    [rec] = result.recoveries
    assert rec["restored_step"] % 4 == 0 and rec["restored_step"] >= 4
    losses = [r["loss"] for r in result.history]
    assert losses[-1] < losses[0]
