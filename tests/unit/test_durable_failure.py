"""A durable write that fails mid-run is a warning the moment the writer sees it: an event of its
own (for the driver's line and a metric), a warning in the log, and the run goes on from memory.
The storage is a real local folder that cannot be made: a file stands where it must go."""

import io
import logging

import numpy as np

from elastic_trainer import TrainerConfig
from elastic_trainer.checkpoint.durable import DurableStore
from elastic_trainer.controller.state.durable_writer import DurableWriter
from elastic_trainer.controller.state.snapshots import SnapshotStore
from elastic_trainer.reporting.progress import ProgressPrinter

from ..conftest import tiny_config


def _shard(step):
    return {"step": step, "blocks": [0, 1], "extra": {},
            "params": {f"blocks.{b}.w": np.full((2, 3), float(b), np.float32) for b in (0, 1)},
            "optim": {f"blocks.{b}.w": {"exp_avg": np.ones((2, 3), np.float32)} for b in (0, 1)}}


def test_a_failed_durable_write_is_an_event_a_warning_and_a_line_at_once(tmp_path, caplog):
    (tmp_path / "file").write_text("in the way")
    storage = str(tmp_path / "file" / "ck")
    cfg = TrainerConfig.from_dict(tiny_config("/nonexistent", checkpoint={"storage": storage, "durable_every": 2}))
    events = []

    def event(kind, **detail):
        events.append({"kind": kind, **detail})
        return events[-1]

    writer = DurableWriter(DurableStore(storage, "run1", retries=0), cfg, {}, SnapshotStore(1, 2), 2, event, "dur")
    with caplog.at_level(logging.WARNING, logger="elastic_trainer.controller.state.durable_writer"):
        assert writer.write(2, [(_shard(2), None, None)], [], {}) is None
    # Recorded before the call returns, on the writer's own thread: not first found at the end.
    assert [e["kind"] for e in events] == ["durable_failed"]
    failed = events[0]
    assert failed["step"] == 2 and failed["storage"] == storage and failed["last_written"] is None
    assert failed["error"].startswith("NotADirectoryError") and "file/ck" in failed["error"]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "[dur] durable checkpoint of step 2 failed" in warned[0].getMessage()
    assert "the run goes on" in warned[0].getMessage()

    out = io.StringIO()
    ProgressPrinter(cfg, out).event(failed)
    assert out.getvalue().startswith("!! durable checkpoint of step 2 failed (the run goes on from memory; none "
                                     "written since the run started): NotADirectoryError")

    # The storage comes back: the next write lands, and a later failure names it as the newest kept.
    (tmp_path / "file").unlink()
    assert writer.write(4, [(_shard(4), None, None)], [], {}) == f"{storage}/step-00000004-run1"
    (tmp_path / "file" / "ck" / "step-00000006-run1").write_text("in the way")
    assert writer.write(6, [(_shard(6), None, None)], [], {}) is None
    assert [e["kind"] for e in events] == ["durable_failed", "durable_checkpoint", "durable_failed"]
    out = io.StringIO()
    ProgressPrinter(cfg, out).event(events[-1])
    assert "(the run goes on from memory; the newest on storage is of step 4)" in out.getvalue()
