"""``status`` reads the worker table on a call's thread while the controller's loop thread adds and
drops workers: the table is a snapshot taken under the pool's lock, never a walk over the live dict."""

import threading

from elastic_trainer import TrainerConfig
from elastic_trainer.controller.run.workers import WorkerHandle, WorkerPool

from ..conftest import tiny_config

_WAIT_S = 30.0   # only reached if the hand-over below never happens


class _Reading(WorkerHandle):
    """A worker whose ``rank`` read, the first time on the reading thread, lets the loop thread drop
    another worker and waits until it has: the drop lands in the middle of the reader's walk."""

    def __init__(self, *args, reader: threading.Thread | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.reader, self.reading, self.dropped = reader, threading.Event(), threading.Event()

    @property
    def rank(self):
        if threading.current_thread() is self.reader and not self.reading.is_set():
            self.reading.set()
            self.dropped.wait(_WAIT_S)
        return self._rank

    @rank.setter
    def rank(self, value):
        self._rank = value


def test_the_table_is_a_snapshot_while_the_loop_thread_drops_a_worker():
    pool = WorkerPool(TrainerConfig.from_dict(tiny_config("/nonexistent")), "locked")
    tables, errors = [], []

    def read():
        try:
            tables.append(pool.table())
        except Exception as e:  # noqa: BLE001 - what the test looks for
            errors.append(e)

    reader = threading.Thread(target=read)
    first = _Reading(0, None, "node-a", 100, "10.0.0.1", rank=0, reader=reader)
    pool.workers = {0: first, 1: WorkerHandle(1, None, "node-b", 101, "10.0.0.2", rank=1),
                    2: WorkerHandle(2, None, "node-c", 102, "10.0.0.3", rank=2)}

    def loop():
        first.reading.wait(_WAIT_S)
        pool.drop([1])   # as a recovery does; its actor (None here) is killed, which may fail quietly
        first.dropped.set()

    mutator = threading.Thread(target=loop)
    mutator.start()
    reader.start()
    reader.join()
    mutator.join()
    assert first.reading.is_set() and first.dropped.is_set()
    assert not errors, errors   # before: RuntimeError: dictionary changed size during iteration
    # The table is the pool as it was when the read began, row for row.
    assert [row["worker_id"] for row in tables[0]] == [0, 1, 2]
    assert [w["worker_id"] for w in pool.table()] == [0, 2] and 1 not in pool


def test_the_table_and_the_nodes_agree_with_the_workers_held():
    pool = WorkerPool(TrainerConfig.from_dict(tiny_config("/nonexistent")), "plain")
    pool.workers = {3: WorkerHandle(3, None, "node-a", 7, "10.0.0.1", rank=None)}
    assert pool.table() == [{"worker_id": 3, "rank": None, "node_id": "node-a", "pid": 7, "ip": "10.0.0.1",
                             "allocator": None, "mark": None}]
    assert pool.nodes() == {"node-a"}
