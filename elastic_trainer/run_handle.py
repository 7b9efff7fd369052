"""``Run``: a handle on a run under way, from ``Trainer.start()``.

A thread of the driver follows the controller (its steps, events and per-rank figures, which it
prints, hands to ``on_step``, the trackers and the rank file) while the caller does as it likes:
asks ``status()``, ``wait(timeout)``s, ``stop()``s the run or takes its ``result()``.
"""

from __future__ import annotations

import contextlib
import re
import signal
import sys
import threading
from typing import Callable

import ray

from .errors import ElasticTrainerError
from .reporting.progress import ProgressPrinter
from .reporting.rank_file import RankFile
from .results import Result
from .storage.uris import mask

_POLL_S = 0.2
_LEAVE_S = 5.0   # how long a finished run's controller gets to leave on its own


class Run:
    """A run started by ``Trainer.start()``: ``status()``, ``wait()``, ``stop()``, ``result()``.

    Where the run started a local Ray of its own, it is shut down when the result is first taken
    (``result()`` or ``stop()``); until then it stays up for ``status()``."""

    def __init__(self, name: str, controller, done_ref, *, printer: ProgressPrinter | None,
                 on_step: Callable[[dict], None] | None, ranks: RankFile | None, trackers,
                 finish: Callable[[dict | None, list, list, BaseException | None], Result],
                 shutdown_ray: bool = False, follow: bool = True):
        """Made by ``Trainer.start()``. ``finish`` turns the controller's output (None where the
        run was aborted) or its error into the ``Result`` or the error ``result()`` gives;
        ``shutdown_ray``: the run started a local Ray, shut down once its result is taken.
        ``follow``: a thread of its own follows the run; else ``result()`` follows it in the
        caller's thread (``fit()``: ``on_step`` runs in the caller's thread, as it always did,
        and a Ctrl-C there interrupts the following, which ``result()`` takes up again)."""
        self.name = name
        self._shutdown_ray = shutdown_ray
        self.controller = controller
        self._done_ref = done_ref
        self._printer, self._on_step, self._ranks, self._trackers = printer, on_step, ranks, trackers
        self._finish = finish
        self._history: list[dict] = []
        self._events: list[dict] = []
        self._ended = threading.Event()
        self._result: Result | None = None
        self._error: BaseException | None = None
        self._aborted: str | None = None   # why the run was ended at once, where it was
        self._seen_ranks = 0
        self._thread = threading.Thread(target=self._follow, name=f"follow-{name}", daemon=True) if follow else None
        if self._thread:
            self._thread.start()

    # -- what the caller sees ------------------------------------------------------------

    @property
    def done(self) -> bool:
        """The run has ended (finished, stopped, aborted or failed)."""
        return self._ended.is_set()

    def status(self) -> dict:
        """Where the run stands: ``state``, ``step``, ``steps``, ``plan``, ``goodput`` and
        ``last_recovery`` (the newest recovery event, or None), plus the controller's whole
        status (``elastic-trainer status`` shows the same) while it runs."""
        if not self.done:
            try:
                st = ray.get(self.controller.status.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                st = None
            if st is not None:
                return {**st, "last_recovery": self._last_recovery()}
            self._ended.wait(5)   # the controller has gone: the follower is ending the run
        if self._result is not None:
            r = self._result
            return {"run": r.run_name, "state": r.state, "step": r.step, "steps": None, "plan": r.plan,
                    "goodput": r.goodput, "last_recovery": self._last_recovery()}
        last = self._last_step()
        return {"run": self.name, "state": "FAILED" if self._error else "UNKNOWN",
                "step": last, "steps": None, "plan": None, "goodput": None,
                "last_recovery": self._last_recovery(),
                "error": mask(str(self._error)) if self._error else None}

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the run to end, at most ``timeout`` seconds; whether it has ended."""
        self._not_from_a_callback("wait")
        if self._thread is None and not self.done:
            raise RuntimeError("this run is followed by fit(), which waits for it; wait() is for start()'s runs")
        return _wait(self._ended, timeout)

    def result(self, timeout: float | None = None) -> Result:
        """The run's ``Result`` once it has ended (waiting at most ``timeout`` seconds: a
        ``TimeoutError`` past it, the run going on); a failed run raises its error."""
        self._not_from_a_callback("result")
        if self._thread is None and not self.done:
            self._follow()   # here, in the caller's thread; a KeyboardInterrupt passes through
        if not _wait(self._ended, timeout):
            raise TimeoutError(f"run {self.name!r} is still running after {timeout:g}s (at step "
                               f"{self._last_step() or 'none yet'})")
        if self._shutdown_ray:
            self._shutdown_ray = False
            ray.shutdown()
        if self._error is not None:
            raise self._error
        return self._result

    def stop(self, save: bool = True, reason: str = "", timeout: float | None = None) -> Result:
        """End the run and return its result. ``save=True``: the step in flight completes, the
        weights and (with ``checkpoint.storage``) a durable checkpoint of it are written, and the
        run ends STOPPED (FINISHED if its last step was already done). ``save=False``: the
        controller ends at once and the run ends ABORTED, keeping only the durable checkpoints
        written before (``Result.durable_path`` names the newest).

        From an ``on_step`` callback (which runs on the thread that follows the run) the stop is
        asked and None returned: the result comes once the callback has returned."""
        following = threading.current_thread() is self._thread
        if not self.done:
            if save:
                try:
                    ray.get(self.controller.stop.remote(reason or "Run.stop()"), timeout=30)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    pass   # it ended meanwhile; the result says how
            else:
                self.abort(reason or "Run.stop(save=False)")
        return None if following else self.result(timeout)

    def abort(self, reason: str) -> None:
        """End the run at once, saving nothing more (``stop(save=False)`` without the wait)."""
        if self.done:
            return
        self._aborted = reason
        ray.kill(self.controller, no_restart=True)

    # -- the follower ---------------------------------------------------------------------

    def _not_from_a_callback(self, what: str) -> None:
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"Run.{what}() from an on_step callback would wait on the thread that runs the "
                               "callback; call stop() there (it asks and returns), and wait elsewhere")

    def _last_step(self) -> int | None:
        last = self._history[-1:]   # a slice: the follower may shorten the list meanwhile
        return last[0]["step"] if last else None

    def _last_recovery(self) -> dict | None:
        rec = next((e for e in reversed(self._events) if e["kind"] == "recovery"), None)
        return dict(rec) if rec else None

    def _follow(self) -> None:
        out, error = None, None
        try:
            out = self._poll()
        except KeyboardInterrupt:
            # Followed in the caller's thread (fit): the caller decides what a Ctrl-C means, and
            # following takes up again where it was (its state is this object's).
            raise
        except BaseException as e:  # noqa: BLE001 - handed to result()
            error = e
        try:
            self._end_controller(graceful=error is None and out is not None)
            with _said("the per-rank figures file"):
                if self._ranks:
                    self._ranks.close()
            try:
                self._result = self._finish(out, self._history, self._events, error)
            except BaseException as e:  # noqa: BLE001
                self._error = e
            with _said("the trackers"):
                if self._trackers:
                    r = self._result
                    self._trackers.close(r.state if r else "FAILED", r.goodput if r else None)
        finally:
            self._ended.set()   # whatever failed above, nobody waits forever

    def _end_controller(self, graceful: bool) -> None:
        """A controller whose run ended well leaves through its own exit (a kill, or Ray's
        shutdown meeting it alive, may print a traceback of its SIGTERM handler); one that does
        not within a few seconds, and any after a failure, is killed."""
        try:
            if graceful:
                ray.wait([self.controller.__ray_terminate__.remote()], timeout=_LEAVE_S)
            ray.kill(self.controller, no_restart=True)
        except Exception:  # noqa: BLE001 - gone already
            pass

    def _poll(self) -> dict | None:
        """Follow until the controller's run ends; its output (None where the run was aborted)."""
        history, events, ranks = self._history, self._events, self._ranks
        while True:
            ready, _ = ray.wait([self._done_ref], timeout=_POLL_S)
            try:
                prog = ray.get(self.controller.progress.remote(len(history), len(events),
                                                               self._seen_ranks if ranks else None))
            except ray.exceptions.RayActorError:
                ready = [self._done_ref]
                prog = {"records": [], "events": [], "length": len(history), "n_events": len(events)}
            if ranks and "ranks" in prog:
                ranks.write(prog["ranks"], prog["ranks_dropped"])
                self._seen_ranks += len(prog["ranks"]) + prog["ranks_dropped"]
            for ev in prog["events"]:
                if self._printer:
                    self._printer.event(ev)
                if self._trackers:
                    self._trackers.event(ev)
            events.extend(prog["events"])
            # A rollback shortens the history: continue from where it stands now.
            del history[prog["length"] - len(prog["records"]):]
            for rec in prog["records"]:
                history.append(rec)
                if self._printer:
                    self._printer.step(rec)
                if self._trackers:
                    self._trackers.step(rec)
                if self._on_step:
                    self._on_step(rec)
            if ready:
                break
        try:
            return ray.get(self._done_ref)
        except ray.exceptions.RayTaskError as e:
            # Our own errors say all in their message (the controller's log has the trace); an
            # unexpected one keeps the remote traceback. Either may quote a URI: masked.
            cause = e.cause if isinstance(e.cause, ElasticTrainerError) else e.as_instanceof_cause()
            with contextlib.suppress(AttributeError, TypeError):
                cause.args = tuple(mask(a) if isinstance(a, str) else a for a in cause.args)
            raise cause from None
        except ray.exceptions.RayActorError:
            if self._aborted:
                return None
            raise


def _wait(event: threading.Event, timeout: float | None) -> bool:
    # In short waits, so that Ctrl-C reaches the main thread while it waits.
    if timeout is None:
        while not event.wait(_POLL_S):
            pass
        return True
    return event.wait(timeout)


def hold_to_the_end(run: Run) -> Result:
    """``run.result()``, with Ctrl-C and SIGTERM taken as stops: the first stops the run saved
    (the result says STOPPED); a second ends it at once, says what was kept and raises
    ``KeyboardInterrupt``. Signals are handled so only from the main thread."""
    main = threading.current_thread() is threading.main_thread()
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    # Which signal came: Ray's waits turn whatever a handler raises into a plain KeyboardInterrupt.
    came: list[str] = []

    def interrupted(signum, frame):
        came.append("SIGTERM" if signum == signal.SIGTERM else "Ctrl-C")
        raise KeyboardInterrupt

    if main:
        for sig in before:
            signal.signal(sig, interrupted)
    asked = 0
    try:
        while True:
            try:
                return run.result()
            except KeyboardInterrupt:
                what = came[-1] if came else "Ctrl-C"
                asked += 1
                if run.done:
                    return run.result()   # it ended meanwhile: its result as it is
                if asked == 1:
                    say(f"{what}: stopping run {run.name!r}: the step in flight completes, then the weights and "
                        "the checkpoint are saved. Again to end at once, unsaved.")
                    _ask_stop(run, f"{what} in the driver")
                    continue
                if main:   # a third signal would cut the report of what was kept short
                    for sig in before:
                        signal.signal(sig, signal.SIG_IGN)
                run.abort(f"{what} again in the driver")
                try:
                    r = run.result()
                except Exception:  # noqa: BLE001 - it failed meanwhile: what was kept is on storage
                    r = None
                kept = (f"the durable checkpoint of step {_step_of(r.durable_path)}: {r.durable_path}"
                        if r is not None and r.durable_path else "no durable checkpoint")
                say(f"{what} again: run {run.name!r} ended at once, unsaved, at step "
                    f"{r.step if r is not None else '?'}; kept {kept}")
                raise KeyboardInterrupt from None
    finally:
        for sig, handler in before.items():
            if handler is not None:   # None: set from outside Python, not ours to restore
                signal.signal(sig, handler)


def _ask_stop(run: Run, reason: str) -> None:
    # Not waited on: the main thread goes back to waiting, where a second signal finds it.
    try:
        run.controller.stop.remote(reason)
    except Exception:  # noqa: BLE001 - the controller has gone: the follower ends the run
        pass


def _step_of(path: str) -> str:
    m = re.search(r"step-(\d+)", path)
    return m.group(1) if m else "?"


@contextlib.contextmanager
def _said(what: str):
    """Closing ``what`` failed: said, not raised (the run's result matters more)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001
        say(f"warning: closing {what} failed: {type(e).__name__}: {e}")


def strip_colour(text: str) -> str:
    """Ray colours the errors it relays; reports and logs want text."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
