"""A run stopped by ``Controller.stop()`` ends STOPPED, not FINISHED, and says so: in its state
machine, its Result, its progress lines and ``elastic-trainer status``. A second ``run()`` on a
controller (any client of the cluster can call one) is refused without touching the run."""

import inspect
import io

import pytest

from elastic_trainer import RunError, TrainerConfig
from elastic_trainer.controller.controller import Controller
from elastic_trainer.controller.run.run_state import TRANSITIONS, RunState, RunStateMachine
from elastic_trainer.reporting.progress import ProgressPrinter
from elastic_trainer.cli.status import format_status
from elastic_trainer.controller.controller import ControllerActor
from elastic_trainer.trainer import Result

from ..conftest import tiny_config


def _cfg():
    raw = tiny_config("/nonexistent")
    raw["train"]["steps"] = 40
    return TrainerConfig.from_dict(raw)


def _rec(step):
    return {"step": step, "loss": 3.0 - step * 0.01, "tokens_per_s": 1000.0, "step_time_s": 0.5,
            "comm_time_s": 0.01, "exposed_comm_s": 0.01, "dp": 1, "pp": 1}


def test_a_stop_ends_a_running_run_in_a_final_state_of_its_own():
    m = RunStateMachine(RunState.RUNNING)
    assert m.move(RunState.STOPPED) == (RunState.RUNNING, RunState.STOPPED)
    assert m.ended and RunState.FINISHED not in TRANSITIONS[RunState.STOPPED]
    # Only the step loop, between steps (RUNNING), leaves on a stop.
    assert [s for s in RunState if RunState.STOPPED in TRANSITIONS[s]] == [RunState.RUNNING]


def test_stop_is_recorded_once_with_the_step_and_not_after_the_end():
    ctl = Controller(tiny_config("/nonexistent"), "stopme")
    ctl.record.step = 7
    assert ctl.stop("operator asked") is True
    assert ctl.stop() is False   # already asked: the first request stands
    asked = [e for e in ctl.record.events if e["kind"] == "stop_requested"]
    assert len(asked) == 1 and asked[0]["step"] == 7 and asked[0]["reason"] == "operator asked"
    assert ctl.status()["stopping"]["step"] == 7 and ctl.record.stopping
    ended = Controller(tiny_config("/nonexistent"), "ended")
    ended.record.machine = RunStateMachine(RunState.FINISHED)
    assert ended.stop() is False and not ended.record.events


def test_a_second_run_call_is_refused_and_leaves_the_running_run_alone():
    # Before: a second run() tried RUNNING -> PLACING, failed the run and tore its workers down.
    ctl = Controller(tiny_config("/nonexistent"), "twice")
    ctl.record.machine = RunStateMachine(RunState.RUNNING)
    with pytest.raises(RunError, match=r"run\(\) was already called on run 'twice' \(state RUNNING\)"):
        ctl.run()
    assert ctl.state is RunState.RUNNING and not ctl.record.events


def test_a_client_of_the_cluster_reaches_only_the_controllers_narrow_surface():
    # Ray makes every method of a named actor's class callable by any driver, private ones too.
    methods = {n for n, _ in inspect.getmembers(ControllerActor, inspect.isfunction) if not n.startswith("__")}
    assert methods == {"run", "stop", "progress", "status", "inject_fault", "worker_handles", "fault_point"}
    actor = ControllerActor(tiny_config("/nonexistent"), "narrow")
    with pytest.raises(PermissionError, match=r"fault injection, which is off in run 'narrow'"):
        actor.worker_handles()
    # A production run has no fault points at all: nothing to arm, nothing held.
    with pytest.raises(PermissionError, match=r"fault injection, which is off in run 'narrow'"):
        actor.fault_point("arm", "in_step")
    assert actor.stop("maintenance") is True and actor.status()["stopping"]["reason"] == "maintenance"
    chaos = ControllerActor(tiny_config("/nonexistent", failure={"allow_fault_injection": True}), "chaos")
    assert chaos.worker_handles() == []


def test_the_progress_says_stopped_at_which_step_not_done():
    out = io.StringIO()
    p = ProgressPrinter(_cfg(), out)
    p.event({"kind": "stop_requested", "step": 11, "reason": ""})
    history = [_rec(s) for s in range(1, 13)]
    p.done(history, state="STOPPED")
    lines = out.getvalue().splitlines()
    assert lines[0] == "!! stop requested at step 11: the run ends after the steps in flight and saves what it has"
    assert lines[1].startswith("stopped at step 12 of 40 (not finished): 12 steps, loss 2.9900 -> 2.8800")
    assert not any(ln.startswith("done") for ln in lines)
    finished = io.StringIO()
    ProgressPrinter(_cfg(), finished).done([_rec(s) for s in range(1, 41)])
    assert finished.getvalue().startswith("done: 40 steps")


def test_status_says_stopping_then_stopped_and_no_time_left():
    base = {"run": "r", "step": 12, "steps": 40, "last": _rec(12), "tokens_per_s": 1000.0, "step_time_s": 0.5,
            "plan": None, "workers": [], "failures": [], "recoveries": 0}
    stopping = format_status({**base, "state": "RUNNING", "stopping": {"step": 11}})
    assert "stop requested at step 11" in stopping.splitlines()[0] and "min left" not in stopping
    stopped = format_status({**base, "state": "STOPPED"}).splitlines()
    assert stopped[0] == "run r: STOPPED at step 12 of 40 (stopped before the last step; what it had is saved)"
    assert "min left" not in "\n".join(stopped)


def test_status_gives_each_rank_its_memory_and_the_allocator_it_runs_on():
    st = {"run": "r", "state": "RUNNING", "step": 12, "steps": 40, "last": _rec(12), "tokens_per_s": 1000.0,
          "step_time_s": 0.5, "plan": None, "failures": [], "recoveries": 0,
          "workers": [{"worker_id": 4, "rank": 0, "pid": 99, "node_id": "abcdef0123456789", "allocator": "jemalloc"},
                      {"worker_id": 5, "rank": 1, "pid": 98, "node_id": "abcdef0123456789", "allocator": None}],
          "memory": {"step_peak_rss_bytes": {"0": 900 * 2**20, "1": 800 * 2**20}}}
    ranks = [ln.strip() for ln in format_status(st).splitlines() if ln.strip().startswith("rank ")]
    assert ranks == ["rank 0: worker 4 pid 99 node abcdef012345 memory 900 MiB on jemalloc",
                     "rank 1: worker 5 pid 98 node abcdef012345 memory 800 MiB"]


def test_the_result_of_a_stopped_run_says_so():
    stopped = Result("r", [_rec(s) for s in range(1, 13)], [], {}, state="STOPPED", step=12)
    assert stopped.stopped and not stopped.finished and stopped.step == 12
    assert Result("r", [], [], {}).finished   # what a Result meant before: a run that finished
