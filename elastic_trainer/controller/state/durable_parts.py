"""Durable checkpoint parts written and read on the nodes, never in the controller.

A part is written by the worker that made it (on a thread of its own, beside
its steps: its object is in that node's store), else by a task on the node
that holds it, and read back against its checksum by its writer
(``DurableStore.write_part``); the controller collects the manifest entries
and writes the manifest. A part is
read by a task that verifies it and keeps it in the object store, where the
ranks that restore from it fetch it: the controller holds refs, not bytes.
"""

from __future__ import annotations

import contextlib
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ...checkpoint.durable import CheckpointError, DurableStore, write_part_here
from ...secrets import carrying
from ...storage.credentials import storage_env

# A part's write (a durable part, a stage's weights) may take this long at the least: its storage
# calls retry within it.
PART_TIMEOUT_S = 300.0


# A task inherits its caller's runtime_env, which holds no secret: each is handed the storage's
# credentials (storage_env) as its first argument (secrets.carrying).
_write_part = ray.remote(num_cpus=0, max_retries=0)(carrying(write_part_here))


def _read_part_here(spec: tuple, name: str, entry: dict, step: int):
    shard = DurableStore(*spec).read_part(name, entry, step)
    return entry["bytes"], shard


_read_part = ray.remote(num_cpus=0, num_returns=2, max_retries=0)(carrying(_read_part_here))


def _raise_cause(e: ray.exceptions.RayTaskError):
    cause = getattr(e, "cause", None)
    if isinstance(cause, Exception):
        raise cause from None
    raise e


class DurableParts:
    """Writes and reads the parts of ``store``'s checkpoints on the nodes. ``timeout_s``: how
    long a part's write or read may take (its storage calls retry within it)."""

    def __init__(self, store: DurableStore, timeout_s: float):
        self.store, self.timeout_s = store, timeout_s

    @property
    def spec(self) -> tuple:
        # Read at each call: a resumed run adopts the run id it continues after this was made.
        return self.store.spec

    def write(self, step: int, parts: list[tuple]) -> list[dict]:
        """Write ``parts`` ((object ref, node id or None, the live worker actor that made it or
        None) covering every block) as the parts of ``step``'s checkpoint; their manifest
        entries, each with its node and seconds. Parts given as values (dicts) are written in
        this process."""
        if all(isinstance(ref, dict) for ref, _, _ in parts):   # values, not refs: written here
            return [self.store.write_part(step, i, shard) for i, (shard, _, _) in enumerate(parts)]

        def task(i: int, ref, node):
            where = NodeAffinitySchedulingStrategy(node, soft=True) if node else "DEFAULT"
            return _write_part.options(scheduling_strategy=where).remote(storage_env(), self.spec, step, i, ref)

        calls = [actor.write_durable_part.remote(self.spec, step, i, ref) if actor is not None else task(i, ref, node)
                 for i, (ref, node, actor) in enumerate(parts)]
        deadline = time.monotonic() + self.timeout_s
        out = []
        for i, call in enumerate(calls):
            try:
                try:
                    out.append(ray.get(call, timeout=max(0.0, deadline - time.monotonic())))
                except ray.exceptions.RayActorError:
                    # Its maker died since: a task on the part's node writes it instead.
                    ref, node, _ = parts[i]
                    out.append(ray.get(task(i, ref, node), timeout=max(0.0, deadline - time.monotonic())))
            except ray.exceptions.RayTaskError as e:
                _raise_cause(e)
            except ray.exceptions.GetTimeoutError:
                for c in calls[i:]:
                    with contextlib.suppress(Exception):   # a finished one is left as it is
                        ray.cancel(c)
                raise TimeoutError(f"the parts of step {step} were not all written in {self.timeout_s:g}s") from None
        return out

    def reader(self, store: DurableStore, name: str, manifest: dict) -> list:
        """Read every part of the checkpoint ``name`` on the nodes (a ``DurableStore.load_dir``
        reader): the parts' object refs, once every one has verified."""
        pairs = [_read_part.options(scheduling_strategy="SPREAD").remote(storage_env(), self.spec, name, entry, manifest["step"])
                 for entry in manifest["files"]]
        try:
            ray.get([size for size, _ in pairs], timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as e:
            _raise_cause(e)
        except ray.exceptions.GetTimeoutError:
            raise CheckpointError(f"checkpoint {name}: its parts were not all read in {self.timeout_s:g}s") from None
        except ray.exceptions.RayError as e:   # a reader's node or process lost
            raise CheckpointError(f"checkpoint {name}: a part's reader was lost: {type(e).__name__}: {e}") from None
        return [part for _, part in pairs]
