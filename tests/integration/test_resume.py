"""--resume continues its own run: found by run.name (or a run id, or a checkpoint path), another
run's checkpoints in the same storage never read or pruned, and a changed config refused unless
the change is one the user accepts (and then listed in the resume event)."""

import pytest

from elastic_trainer import RunError, Trainer

from ..helpers import reference_losses
from .test_recovery import config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _files(storage, run_id) -> dict:
    return {str(p.relative_to(storage)): p.read_bytes() for p in storage.glob(f"step-*-{run_id}/*")}


def test_resume_continues_its_own_run_and_refuses_unaccepted_changes(cluster, corpus_dir, tmp_path):
    storage = tmp_path / "ck"
    ck = {"storage": str(storage), "durable_every": 2, "keep_durable": 2}
    first = Trainer(config(corpus_dir, "resa", steps=4, checkpoint=ck), verbose=False).fit()
    # Another run in the same storage, written after the first: the newest there.
    other = Trainer(config(corpus_dir, "resb", steps=6, checkpoint=ck), verbose=False).fit()
    theirs = _files(storage, other.run_id)
    assert len({name.split("/")[0] for name in theirs}) == 2

    more = config(corpus_dir, "resa", steps=8, checkpoint=ck)
    with pytest.raises(RunError, match=r"train\.steps: checkpoint 4, this run 8.*--accept-change train\.steps"):
        Trainer(more, verbose=False).fit(resume=True)
    resumed = Trainer(more, verbose=False).fit(resume=True, accept_change=["train.steps"])
    assert resumed.run_id == first.run_id
    [ev] = [e for e in resumed.events if e["kind"] == "resume"]
    assert ev["step"] == 4 and ev["run_id"] == first.run_id
    assert ev["accepted"] == [{"field": "train.steps", "checkpoint": 4, "run": 8}]
    # A constant rate: four more steps are the steps an 8-step run would have taken.
    assert [r["step"] for r in resumed.history] == list(range(1, 9))
    assert [r["loss"] for r in resumed.history] == pytest.approx(reference_losses(more, 8), rel=1e-4)
    # It pruned its own checkpoints only; the other run's are as they were.
    assert sorted(p.name[:13] for p in storage.glob(f"step-*-{first.run_id}")) == ["step-00000006", "step-00000008"]
    assert _files(storage, other.run_id) == theirs

    # From an older checkpoint of the other run, by its path: a branch under an id of its own,
    # which leaves that run's checkpoints alone.
    branch = Trainer(config(corpus_dir, "resc", steps=6, checkpoint=ck), verbose=False).fit(
        resume=str(storage / f"step-00000004-{other.run_id}"))
    [ev] = [e for e in branch.events if e["kind"] == "resume"]
    assert ev["step"] == 4 and ev["branched_from"] == other.run_id and branch.run_id != other.run_id
    assert _files(storage, other.run_id) == theirs

    # A run.name with no checkpoint there starts fresh, naming the runs that are there.
    fresh = Trainer(config(corpus_dir, "resd", steps=2, checkpoint=ck), verbose=False).fit(resume=True)
    [ev] = [e for e in fresh.events if e["kind"] == "resume"]
    assert "starting fresh" in ev["detail"] and f"{first.run_id} (resa)" in ev["detail"]
    assert [r["step"] for r in fresh.history] == [1, 2] and fresh.run_id not in (first.run_id, other.run_id)
