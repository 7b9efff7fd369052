"""Which group a rank's step is blocked in, read off its training thread's Python frames.

After a failure the controller cuts the groups that lost a member and waits for
the survivors' steps to end; what it cannot tell from outside is whether a
survivor still in its step can end by itself. A step blocked in a group whose
other members have all left their steps, on an operation none of them issued,
cannot: only a cut ends it (``controller.stuck_steps.stuck``). This module names
the waits that happen there: a pipeline stage's point-to-point wait (torch's
``_wait_batch_p2p``), the wait for the gradients' all-reduce (``GradSync.finish``
joining its comm thread), and any blocking collective of torch's on a group
the rank holds (the gradient norm's all-reduce over the pipeline, say), by its
``group`` argument. Anywhere else it says nothing, and the controller waits
for the step as before.
"""

from __future__ import annotations

import sys
import threading

_THREADING = threading.__file__
_PIPELINE_WAIT = ("_wait_batch_p2p", "torch/distributed/pipelining/schedules.py")
_COLLECTIVES = "torch/distributed/distributed_c10d.py"


def waiting_in(thread_id: int | None, role_of=lambda group: None) -> str | None:
    """``"pp"`` or ``"dp"``: the role of the group the thread ``thread_id`` now waits in, where it
    is blocked at a wait this module knows; else None (running, or waiting elsewhere).
    ``role_of``: the role of a process group this rank holds, None for any other."""
    frame, joined = _innermost(thread_id)
    if frame is None:
        return None
    code = frame.f_code
    path = code.co_filename.replace("\\", "/")
    if code.co_name == _PIPELINE_WAIT[0] and path.endswith(_PIPELINE_WAIT[1]):
        return "pp"
    if path.endswith(_COLLECTIVES) and "group" in code.co_varnames:
        return role_of(frame.f_locals.get("group"))
    if joined and code is _grad_sync_finish():
        return "dp"
    return None


def where(thread_id: int | None) -> str | None:
    """``file:function:line`` of the thread's innermost frame outside ``threading``: where a step
    the controller waits on is, when it is at no wait ``waiting_in`` names."""
    frame, _ = _innermost(thread_id)
    if frame is None:
        return None
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}:{frame.f_lineno}"


def _innermost(thread_id: int | None):
    """The thread's innermost frame outside ``threading``, and whether frames of ``threading``
    were inside it (a join or an event's wait)."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    joined = False
    while frame is not None and frame.f_code.co_filename == _THREADING:
        frame, joined = frame.f_back, True
    return frame, joined


def _grad_sync_finish():
    from ..comm.grad_sync import GradSync
    return GradSync.finish.__code__
