"""The run's history beside its durable checkpoints: each write adds the records since the last,
so a run writes bytes linear in its steps (it wrote the whole history into every manifest:
quadratic), and a checkpoint's history is exactly its timeline's (checkpoint/history_log.py)."""

import json

from elastic_trainer.checkpoint.durable import DurableStore
from elastic_trainer.checkpoint.history_log import HistoryLog, manifest_history


def _rec(step, timeline="a"):
    return {"step": step, "loss": 1.0 / step, "timeline": timeline}


def _segment_bytes(root) -> int:
    return sum(p.stat().st_size for p in root.glob("history-*/*.json"))


def test_each_write_adds_only_the_steps_since_the_last_and_bytes_grow_linearly(tmp_path):
    store = DurableStore(str(tmp_path), run_id="r1")
    log = HistoryLog(store)
    history, sizes = [], []
    for step in range(1, 401):
        history.append(_rec(step))
        if step % 20 == 0:
            seq = log.write(step, history)
            sizes.append(_segment_bytes(tmp_path))
    # Every write adds 20 records' worth: the last adds what the first did, not 20x more.
    grows = [b - a for a, b in zip(sizes, sizes[1:])]
    assert max(grows) < 1.2 * min(grows), grows
    assert log.read(seq, 400) == history
    assert log.read(seq, 130) == history[:130]
    # The history a manifest written before segments stands for is its own list.
    assert manifest_history(store, {"step": 2, "history": [_rec(1)]}) == [_rec(1)]
    assert manifest_history(store, {"step": 40, "history_seq": 2, "run_id": "r1"}) == history[:40]


def test_after_a_rollback_the_redone_steps_replace_those_of_the_abandoned_timeline(tmp_path):
    store = DurableStore(str(tmp_path), run_id="r1")
    log = HistoryLog(store)
    history = [_rec(s) for s in range(1, 11)]
    first = log.write(10, history)           # timeline a to step 10
    history = history[:6] + [_rec(s, "b") for s in range(7, 13)]   # rolled back to 6, redone to 12
    second = log.write(12, history)
    assert log.read(second, 12) == history
    assert [h["timeline"] for h in log.read(second, 12)][5:8] == ["a", "b", "b"]
    # The checkpoint of step 10 keeps its own timeline's records.
    assert log.read(first, 10) == [_rec(s) for s in range(1, 11)]
    # A new writer of the same run (a resume) numbers its segments after those there.
    again = HistoryLog(DurableStore(str(tmp_path), run_id="r1"))
    third = again.write(13, history + [_rec(13, "b")])
    assert third == second + 1 and len(again.read(third, 13)) == 13
    names = sorted(p.name for p in (tmp_path / "history-r1").iterdir())
    assert names[0].startswith("00000001-00000001-00000010") and json.loads((tmp_path / "history-r1" / names[0]).read_text())
