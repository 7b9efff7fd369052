"""Typed results: step records and events with named fields that still read as the dicts they
were, tables of them, and the checkpoint a result names."""

import json

from elastic_trainer.results import Event, Events, History, Result, StepRecord


def _rec(step, **more):
    return {"step": step, "loss": 2.0 - step / 10, "lr": 1e-3, "dp": 2, "pp": 1, "step_time_s": 0.5,
            "exposed_comm_s": 0.1, "tokens_per_s": 100.0, "snapshot": {"tier": "memory"}, **more}


def test_a_record_has_named_fields_and_reads_as_its_dict():
    raw = _rec(3, eval_loss=1.5)
    rec = StepRecord.from_dict(raw)
    assert rec.step == 3 and rec.loss == raw["loss"] and rec.comm_share == 0.2
    assert rec["eval_loss"] == 1.5 and rec.extra == {"eval_loss": 1.5} and rec.get("absent") is None
    assert rec == raw and rec.get("loss_scale", 1.0) == 1.0 and "loss_scale" not in rec
    assert rec.loss_scale is None   # a field the record lacked reads None as an attribute
    assert json.loads(json.dumps(rec.to_dict()))["snapshot"] == {"tier": "memory"}
    assert "loss" in rec and "absent" not in rec and dict(rec)["dp"] == 2


def test_history_and_events_become_tables_and_events_go_by_kind():
    h = History.of([_rec(1), _rec(2, eval_loss=1.0)])
    table = h.to_arrow()
    assert table.column("step").to_pylist() == [1, 2] and table.column("eval_loss").to_pylist() == [None, 1.0]
    assert table.column("snapshot").to_pylist()[0] == repr({"tier": "memory"})   # nested: as text
    assert list(h.to_pandas()["loss"]) == [r.loss for r in h]
    ev = Events.of_dicts([{"kind": "state", "to": "RUNNING", "time": 1.0},
                          {"kind": "failure", "failure": "death", "step": 4, "time": 2.0},
                          {"kind": "recovery", "reason": "death", "time": 3.0}])
    assert ev.kinds == ["state", "failure", "recovery"] and ev.of("failure")[0].step == 4
    assert isinstance(ev[0], Event) and ev[0]["to"] == "RUNNING" and ev.to_dicts()[1]["failure"] == "death"


def test_a_result_names_its_checkpoint_and_types_what_it_holds():
    r = Result(run_name="r", history=[_rec(1), _rec(2)], events=[{"kind": "recovery", "reason": "death"}], plan={},
               state="STOPPED", step=2, durable_path="/ck/step-00000002-abc", model_path="/out", run_id="abc")
    assert isinstance(r.history[0], StepRecord) and r.final_loss == r.history[-1].loss
    assert r.recoveries[0]["reason"] == "death" and r.stopped and not r.aborted
    ck = r.checkpoint
    assert (ck.step, ck.path, ck.weights, ck.run_id) == (2, "/ck/step-00000002-abc", "/out", "abc")
