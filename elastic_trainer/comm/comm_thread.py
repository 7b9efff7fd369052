"""One long-lived thread that runs a rank's gradient exchanges, step after step.

A thread started each step gets its own malloc arena from glibc for what it
allocates (the backend's scratch buffers of a reduce-scatter, a codec's
copies), and freed memory stays in the arena it came from: with a fresh
thread every step, a sharded rank grew by about a gradient's size a step
(a GPT of 4 layers x 640 at dp=2, two processes: 770 MB resident after 8
steps whole, 1224 MB sharded; with one thread kept, 945 MB, flat from step 3;
``benchmarks/shard_memory.py``).
The thread is replaced only when a step left it
stuck in a collective (an aborted step whose peer died): that one is left to
end on its own.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class CommThread:
    """Runs the callables given to ``submit`` one after another on one daemon thread."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        """No job running or waiting."""
        with self._lock:
            return self._pending == 0

    def submit(self, fn: Callable[[], None]) -> threading.Event:
        """Run ``fn`` after the jobs before it; the event is set when it has returned (or raised)."""
        done = threading.Event()
        with self._lock:
            self._pending += 1
        self._jobs.put((fn, done))
        return done

    def retire(self) -> None:
        """End the thread once the jobs given so far are done."""
        self._jobs.put((None, None))

    def _run(self) -> None:
        while True:
            fn, done = self._jobs.get()
            if fn is None:
                return
            try:
                fn()
            finally:
                with self._lock:
                    self._pending -= 1
                done.set()
