"""Sharded parameter server: the ``comm.sync: parameter_server`` alternative to all-reduce.

Each DP replica pushes the gradients of the parameters it holds to the shard
that owns them and pulls back the updated parameters; the shards hold the fp32
master copy and the optimizer state, so workers never step their own optimizer.

- ``assign_shards``: parameter name -> shard index, balanced by size.
- ``ParameterServerShard``: a plain class (no Ray import), wrapped by
  ``remote_shard_class()`` into a threaded actor.
- ``PSClient``: the worker side, ``push_pull(step, stats)`` per step.

Protocol of step ``s`` (a shard built or loaded at step ``k`` expects ``k + 1``):
every replica ``r < n_workers`` (``n_workers`` = dp) pushes the gradients of its
names on that shard once; a name is updated when all ``n_workers`` replicas
pushed it. Replicas of one stage push the same names, so the last replica's push
steps that stage's parameters in one ``optimizer.step()`` without waiting for
the other stages on the same shard (the optimizer, AdamW or ``train.optimizer``'s, is
per-parameter, so stepping a subset is exact). ``pull(s, names)`` returns them once updated.

Clipping is not done here: a shard sees only some names, so it cannot know the
global norm. The worker clips its own gradients (norm over its replica, summed
over its PP group) before pushing; with ``grad_clip`` set the update is the mean
of per-replica clipped gradients, not the all-reduce path's clip of the mean.

Recovery: a push for a step a shard already applied is ignored, and a second
push of one (step, replica) counts once (the first wins), so a retried step
never double-counts. After a restore to an older step, ``load_state`` the
shards from the same snapshot; ``reset_pending`` drops an abandoned step's pushes.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch

from ..checkpoint.state import block_of, export_shard, load_into, merge_shards
from ..config import TrainSection
from ..lr_schedule import lr_at, set_lr
from ..optim.build import build_optimizer
from .stats import CommStats


def assign_shards(named_sizes: dict[str, int], n_shards: int) -> dict[str, int]:
    """Deal parameter names to ``n_shards`` shards of near-equal total size, largest first.

    Ties break by name and shard index, so every process computes the same map.
    """
    if n_shards < 1:
        raise ValueError(f"n_shards({n_shards}) must be >= 1")
    bad = {n: s for n, s in named_sizes.items() if s < 0}
    if bad:
        raise ValueError(f"parameter sizes must be >= 0, got {bad}")
    load = [0] * n_shards
    count = [0] * n_shards
    out: dict[str, int] = {}
    for name in sorted(named_sizes, key=lambda n: (-named_sizes[n], n)):
        i = min(range(n_shards), key=lambda i: (load[i], count[i], i))
        out[name] = i
        load[i] += named_sizes[name]
        count[i] += 1
    return out


def _examples(names: Iterable[str], k: int = 3) -> str:
    names = sorted(names)
    return ", ".join(repr(n) for n in names[:k]) + (f" (+{len(names) - k} more)" if len(names) > k else "")


class ParameterServerShard:
    """Master copy and optimizer state of one shard's parameters; thread-safe.

    ``params``: name -> array (global names; may be a superset, ``names`` picks
    this shard's). ``train``: a TrainSection or its dict. ``step``: the step the
    params are after. Blocking calls wait up to ``timeout_s``.
    """

    def __init__(self, params: Mapping[str, np.ndarray], train, n_workers: int, *, names: Iterable[str] | None = None,
                 step: int = 0, shard_index: int = 0, timeout_s: float = 300.0, torch_threads: int | None = None):
        if n_workers < 1:
            raise ValueError(f"n_workers({n_workers}) must be >= 1 (it is the DP degree)")
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        names = sorted(params if names is None else names)
        missing = [n for n in names if n not in params]
        if missing:
            raise ValueError(f"shard {shard_index}: no initial value given for {_examples(missing)}")
        self.shard_index, self.n_workers, self.timeout_s = shard_index, n_workers, timeout_s
        self._params = {n: torch.nn.Parameter(torch.tensor(np.asarray(params[n]), dtype=torch.float32))
                        for n in names}
        # The rate of each step comes from the schedule, as on the workers (lr_schedule.lr_at).
        self._train = train if isinstance(train, TrainSection) else TrainSection.model_validate(dict(train))
        # The workers' optimizer, built as they build it (param groups by name included), so both
        # paths compute the same update.
        self._optimizer = build_optimizer(list(self._params.items()), self._train)
        self._version = {n: step for n in names}  # last step applied to each name
        self._base_step = step                     # the step of a shard that owns no names
        self._pending: dict[str, dict[int, torch.Tensor]] = {n: {} for n in names}  # name -> replica -> grad
        self._cond = threading.Condition()
        # Bumped when pending pushes are dropped: pulls waiting on them end at once.
        self._epoch = 0

    # -- one step -----------------------------------------------------------
    def push(self, step: int, replica: int, grads: Mapping[str, np.ndarray]) -> int:
        """Record ``replica``'s gradients for ``step``; apply each name once all replicas pushed it.

        Returns how many names this push counted (0 for a full duplicate).
        """
        unknown = [n for n in grads if n not in self._params]
        if unknown:
            raise KeyError(f"shard {self.shard_index} does not own {_examples(unknown)}; "
                           f"it owns {len(self._params)} names, e.g. {_examples(self._params)}")
        with self._cond:
            if not 0 <= replica < self.n_workers:
                raise ValueError(f"shard {self.shard_index}: replica({replica}) is not in "
                                 f"range(n_workers={self.n_workers})")
            fresh = []
            for name, g in grads.items():
                v = self._version[name]
                if step > v + 1:
                    raise ValueError(f"shard {self.shard_index}: push for step {step} of {name!r}, which is at "
                                     f"step {v}; expected step {v + 1} (load_state the shard after a restore)")
                if step <= v or replica in self._pending[name]:
                    continue  # already applied or already counted: a retry must not count twice
                p = self._params[name]
                if tuple(np.shape(g)) != tuple(p.shape):
                    raise ValueError(f"shard {self.shard_index}: gradient of {name!r} from replica {replica} "
                                     f"has shape {tuple(np.shape(g))}, the parameter {tuple(p.shape)}")
                g = g.detach().to("cpu", torch.float32) if torch.is_tensor(g) else \
                    torch.tensor(np.asarray(g), dtype=torch.float32)
                fresh.append((name, g))
            # Recorded only after every name passed its checks, so a rejected push leaves nothing half-counted.
            for name, g in fresh:
                self._pending[name][replica] = g
            ready = [n for n, _ in fresh if len(self._pending[n]) == self.n_workers]
            if ready:
                self._apply(ready, step)
                self._cond.notify_all()
            return len(fresh)

    def _apply(self, names: list[str], step: int) -> None:
        with torch.no_grad():
            for n in names:
                parts = self._pending[n]
                # Summed in replica order, not arrival order, so the result is the same every run.
                total = parts[0].clone()
                for r in range(1, self.n_workers):
                    total += parts[r]
                self._params[n].grad = total.div_(self.n_workers)
        # torch optimizers skip parameters whose grad is None, so only these names step.
        set_lr(self._optimizer, lr_at(self._train, step))
        self._optimizer.step()
        for n in names:
            self._params[n].grad = None
            self._pending[n] = {}
            self._version[n] = step

    def pull(self, step: int, names: Iterable[str] | None = None,
             timeout_s: float | None = None) -> dict[str, np.ndarray]:
        """The parameters ``names`` (default: all) after ``step``, waiting until that update is applied."""
        names = sorted(self._params if names is None else names)
        unknown = [n for n in names if n not in self._params]
        if unknown:
            raise KeyError(f"shard {self.shard_index} was asked for {_examples(unknown)}, which it does not own")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._cond:
            epoch = self._epoch
            if not self._cond.wait_for(
                    lambda: self._epoch != epoch or all(self._version[n] >= step for n in names), timeout):
                raise TimeoutError(self._waiting_message(f"pull(step={step})", step, names, timeout))
            if self._epoch != epoch and not all(self._version[n] >= step for n in names):
                raise RuntimeError(f"shard {self.shard_index}: pull(step={step}) abandoned: the step's "
                                   "pending pushes were dropped (a recovery is under way)")
            self._check_not_past(f"pull(step={step})", step, names)
            # Copied under the lock: a threaded actor serialises the result after returning,
            # when another thread may already be applying the next step in place.
            return {n: self._params[n].detach().numpy().copy() for n in names}

    def _check_not_past(self, what: str, step: int, names: list[str]) -> None:
        past = [n for n in names if self._version[n] > step]
        if past:
            raise ValueError(f"shard {self.shard_index}: {what} but {_examples(past)} are already at step "
                             f"{max(self._version[n] for n in past)}; load_state the shard to go back")

    def _waiting_message(self, what: str, step: int, names: list[str], timeout: float) -> str:
        behind = [n for n in names if self._version[n] < step]
        by_missing: dict[tuple, list[str]] = {}
        for n in behind:
            if self._version[n] < step - 1:
                key = ("steps", self._version[n])
            else:
                key = ("replicas", tuple(r for r in range(self.n_workers) if r not in self._pending[n]))
            by_missing.setdefault(key, []).append(n)
        parts = []
        for (kind, what_missing), group in sorted(by_missing.items()):
            if kind == "steps":
                parts.append(f"{len(group)} names ({_examples(group)}) are at step {what_missing}, "
                             f"steps {what_missing + 1}..{step} were never pushed")
            else:
                parts.append(f"{len(group)} names ({_examples(group)}) miss pushes from replicas "
                             f"{list(what_missing)} of n_workers={self.n_workers}")
        return f"shard {self.shard_index}: {what} timed out after {timeout:g}s: " + "; ".join(parts)

    # -- state --------------------------------------------------------------
    def version(self) -> int:
        """The last step applied to every name of this shard."""
        with self._cond:
            return min(self._version.values(), default=self._base_step)

    def export_state(self, step: int | None = None, timeout_s: float | None = None) -> dict:
        """A copy in the layout-free shard format (params, optimizer state, step).

        ``step``: wait for that step and refuse any other; None: the current
        state, which must not be mid-step (some names updated, others not).
        """
        names = sorted(self._params)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._cond:
            if step is not None:
                if not self._cond.wait_for(lambda: all(self._version[n] >= step for n in names), timeout):
                    raise TimeoutError(self._waiting_message(f"export_state(step={step})", step, names, timeout))
                self._check_not_past(f"export_state(step={step})", step, names)
            steps = {}
            for n in names:
                steps.setdefault(self._version[n], []).append(n)
            if len(steps) > 1:
                split = ", ".join(f"step {s}: {len(g)} names, e.g. {g[0]!r}" for s, g in sorted(steps.items()))
                raise ValueError(f"shard {self.shard_index} is mid-step ({split}); export after every "
                                 f"replica pushed, or pass the step to wait for")
            at = next(iter(steps), self._base_step)
            blocks = sorted({block_of(n) for n in names})
            return export_shard(at, self._params.items(), self._optimizer, blocks,
                                extra={"ps_shard": self.shard_index, "ps_n_workers": self.n_workers})

    def load_state(self, state: dict | list[dict]) -> int:
        """Restore this shard's names from one or more shards of one step; drops pending pushes.

        Names without optimizer state in ``state`` start the optimizer afresh. Returns the step.
        """
        names = set(self._params)
        # Object refs (a restore passes them unresolved) are read one at a time, each cut at once to
        # this shard's names: a shard never holds more of the model than its own part.
        shards = [_own_part(_resolve(s), names) for s in ([state] if isinstance(state, dict) else list(state))]
        with self._cond:
            step, params, optim = merge_shards(shards, sorted(self._params))
            load_into(self._params.items(), self._optimizer, params, optim)
            self._version = {n: step for n in self._params}
            self._base_step = step
            self._pending = {n: {} for n in self._params}
            self._epoch += 1
            self._cond.notify_all()
            return step

    def reset_pending(self, n_workers: int | None = None) -> int:
        """Drop the pushes of an unfinished step (and take a new DP degree); pulls waiting on
        them fail at once. Returns how many pushes were dropped."""
        if n_workers is not None and n_workers < 1:
            raise ValueError(f"n_workers({n_workers}) must be >= 1 (it is the DP degree)")
        with self._cond:
            dropped = sum(len(p) for p in self._pending.values())
            self._pending = {n: {} for n in self._params}
            self._epoch += 1
            if n_workers is not None:
                self.n_workers = n_workers
            self._cond.notify_all()
            return dropped


def _resolve(part):
    """``part``, or the value of the object ref it is."""
    if isinstance(part, dict):
        return part
    import ray

    return ray.get(part)


def _own_part(part: dict, names: set[str]) -> dict:
    """``part`` with only ``names``' parameters, slices and moments."""
    out = dict(part)
    for key in ("params", "optim", "ranges", "optim_ranges"):
        if part.get(key):
            out[key] = {n: v for n, v in part[key].items() if n in names}
    return out


def remote_shard_class(**actor_options):
    """``ray.remote(ParameterServerShard)`` as a threaded actor.

    Each waiting pull holds a thread, so ``max_concurrency`` must exceed the
    number of workers (dp * pp) plus control calls; the default of 64 leaves room.
    ``num_cpus`` defaults to 0 because on CPU clusters the workers hold every slot.
    """
    import ray

    return ray.remote(**{"num_cpus": 0, "max_concurrency": 64, **actor_options})(ParameterServerShard)


def _ray_get(refs: list, timeout: float | None) -> list:
    import ray

    return ray.get(refs, timeout=timeout)


class PSClient:
    """A worker's link to the shards: push its gradients, pull its parameters back.

    ``named_parameters``: this worker's global name -> tensor (or pairs);
    ``shards``: actor handles indexed as in ``assignment``. ``get`` resolves a
    list of refs with a timeout (default ``ray.get``).
    """

    def __init__(self, named_parameters, shards: list, assignment: Mapping[str, int], replica: int,
                 n_replicas: int, *, timeout_s: float = 300.0, get: Callable[[list, float | None], list] | None = None):
        self.params: dict[str, torch.Tensor] = dict(named_parameters)
        if not 0 <= replica < n_replicas:
            raise ValueError(f"replica({replica}) is not in range(n_replicas={n_replicas})")
        unassigned = [n for n in self.params if n not in assignment]
        if unassigned:
            raise ValueError(f"no shard assigned to {_examples(unassigned)}; the assignment has "
                             f"{len(assignment)} names, e.g. {_examples(assignment)}")
        bad = {n: assignment[n] for n in self.params if not 0 <= assignment[n] < len(shards)}
        if bad:
            raise ValueError(f"assignment names shards {sorted(set(bad.values()))} "
                             f"but {len(shards)} handles were given")
        self.shards, self.replica, self.n_replicas, self.timeout_s = shards, replica, n_replicas, timeout_s
        self._get = get or _ray_get
        by_shard: dict[int, list[str]] = {}
        for n in self.params:
            by_shard.setdefault(assignment[n], []).append(n)
        self._by_shard = sorted(by_shard.items())

    def _grad(self, name: str) -> np.ndarray:
        p = self.params[name]
        # A parameter the step did not reach counts as a zero gradient, as in the all-reduce path with dp > 1.
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g.detach()
        if g.dtype == torch.bfloat16:
            g = g.float()  # numpy has no bfloat16
        return g.to("cpu").contiguous().numpy()

    def push_pull(self, step: int, stats: CommStats | None = None) -> None:
        """Push this replica's gradients of ``step`` to every shard, then pull and load the new parameters.

        All pushes go out before any pull, and every shard works in parallel.
        Counts gradient bytes as ``ps_push`` and parameter bytes as ``ps_pull``.
        """
        t0 = time.perf_counter()
        pushes, sent = [], 0
        for i, names in self._by_shard:
            grads = {n: self._grad(n) for n in names}
            sent += sum(a.nbytes for a in grads.values())
            pushes.append(self.shards[i].push.remote(step, self.replica, grads))
        pulls = [self.shards[i].pull.remote(step, names, self.timeout_s) for i, names in self._by_shard]
        # Pushes are awaited first so that a rejected push raises its own error, not a pull timeout.
        self._get(pushes, self.timeout_s)
        t1 = time.perf_counter()
        # Every pull resolves before any copy, so a failed step leaves this worker's
        # parameters wholly at the previous step, never half updated.
        received = 0
        with torch.no_grad(), warnings.catch_warnings():
            # Object-store arrays are read-only; they are only read here.
            warnings.simplefilter("ignore", UserWarning)
            for (i, names), values in zip(self._by_shard, self._get(pulls, self.timeout_s + 10.0)):
                for n in names:
                    a, p = values[n], self.params[n]
                    if tuple(a.shape) != tuple(p.shape):
                        raise ValueError(f"shard {i} returned {n!r} with shape {tuple(a.shape)}, "
                                         f"this worker holds {tuple(p.shape)}")
                    p.copy_(torch.from_numpy(a))
                    received += a.nbytes
        t2 = time.perf_counter()
        if stats is not None:
            stats.add("ps_push", sent, t1 - t0)
            stats.add("ps_pull", received, t2 - t1)
