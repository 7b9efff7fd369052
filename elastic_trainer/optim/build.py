"""A rank's optimizer from ``train.optimizer``: its class, its arguments, and its parameter groups.

Groups are formed from the global parameter names (``blocks.<index>.<name>``) the caller holds:
a rank holds only its blocks (or a sharded optimizer's slices of them, named as their
parameter), so each rank's optimizer has the groups that apply to it, and every layout steps
a parameter with the same hyper-parameters. A parameter goes to the first group whose
pattern matches its name, else to the base group (``train.optimizer.kwargs``).

The learning rate: ``train.lr`` is every group's peak; a group that sets its own ``lr`` keeps
its ratio to ``train.lr`` (``lr_ratio`` in the torch param group), which
``lr_schedule.set_lr`` applies to the schedule's rate each step.

``train.weight_decay``, ``betas`` and ``eps`` (the fields of the AdamW-only days) still apply:
AdamW takes weight decay 0.01 by default, as before; any optimizer takes those fields where
given other than their defaults (and where its class has the argument: checked with the config).
"""

from __future__ import annotations

import fnmatch
import re
from typing import Iterable

import torch

from ..errors import ConfigError
from .choice import PATTERN_KEYS, check_spec, resolve, try_build

# train.weight_decay's default, which only AdamW takes when nothing else is said.
ADAMW_WEIGHT_DECAY = 0.01


def legacy_given(train) -> dict:
    """The AdamW fields of ``train`` given other than their defaults (a ``TrainSection``)."""
    out = {}
    if train.weight_decay != ADAMW_WEIGHT_DECAY:
        out["weight_decay"] = train.weight_decay
    if train.betas is not None:
        out["betas"] = tuple(train.betas)
    if train.eps is not None:
        out["eps"] = train.eps
    return out


def base_kwargs(train, cls: type) -> dict:
    """The arguments of the base group: lr, the legacy fields (``legacy_given``; AdamW's default
    weight decay), then ``train.optimizer.kwargs``."""
    kwargs: dict = {"lr": train.lr}
    if cls is torch.optim.AdamW:
        kwargs["weight_decay"] = ADAMW_WEIGHT_DECAY
    kwargs.update(legacy_given(train))
    kwargs.update(train.optimizer.kwargs)
    return kwargs


def check_train(train) -> type:
    """Check ``train.optimizer`` (of a ``TrainSection``) against its class, the AdamW fields of
    ``train`` with it, and make it once with those arguments (``choice.try_build``); the class."""
    o = train.optimizer
    cls = check_spec(o.name, o.kwargs, o.param_groups, legacy_given(train), "none")
    kwargs = base_kwargs(train, cls)
    try_build(cls, {k: v for k, v in kwargs.items() if k != "lr"}, o.param_groups, train.lr)
    return cls


def matches(group: dict, name: str) -> bool:
    """Whether ``name`` is matched by ``group``'s pattern (``match``: a glob; ``regex``: searched)."""
    if "match" in group:
        return fnmatch.fnmatchcase(name, group["match"])
    return re.search(group["regex"], name) is not None


def group_of(groups: list[dict], name: str) -> int | None:
    """Index of the first of ``groups`` that matches ``name``; None: the base group."""
    return next((i for i, g in enumerate(groups) if matches(g, name)), None)


def build_optimizer(params: Iterable, train) -> torch.optim.Optimizer:
    """The optimizer ``train`` (a ``TrainSection``) names over ``params``: ``(global name, tensor)``
    pairs, or bare tensors where no param group is configured."""
    params = list(params)
    spec = train.optimizer
    cls = resolve(spec.name)
    kwargs = base_kwargs(train, cls)
    named = bool(params) and isinstance(params[0], tuple)
    if not spec.param_groups:
        return cls([p for _, p in params] if named else params, **kwargs)
    if not named:
        raise ValueError("train.optimizer.param_groups match parameter names: give (name, tensor) pairs")
    chosen: list[list] = [[] for _ in range(len(spec.param_groups) + 1)]
    for name, p in params:
        i = group_of(spec.param_groups, name)
        chosen[0 if i is None else i + 1].append(p)
    groups = [{"params": chosen[0]}] if chosen[0] else []
    for g, ps in zip(spec.param_groups, chosen[1:]):
        if not ps:
            continue   # this rank holds none of the group's parameters
        over = {k: v for k, v in g.items() if k not in PATTERN_KEYS}
        if "lr" in over:
            over["lr_ratio"] = over["lr"] / train.lr
        groups.append({"params": ps, **over})
    return cls(groups, **kwargs)


def check_patterns(spec, names: list[str]) -> None:
    """ConfigError unless each of ``spec.param_groups`` takes some of the model's parameters
    (``names``: every global parameter name), left after the groups before it."""
    taken: dict[int, list[str]] = {}
    for n in names:
        i = group_of(spec.param_groups, n)
        if i is not None:
            taken.setdefault(i, []).append(n)
    for i, g in enumerate(spec.param_groups):
        if i in taken:
            continue
        key = "match" if "match" in g else "regex"
        earlier = [j for j, h in enumerate(spec.param_groups[:i]) if any(matches(g, n) for n in taken.get(j, []))]
        why = (f"the parameters it matches are taken by param_groups{earlier} before it" if earlier
               else "it matches no parameter of the model")
        sample = ", ".join(names[:4] + ["..."] + names[-2:] if len(names) > 6 else names)
        raise ConfigError(f"train.optimizer.param_groups[{i}].{key}({g[key]!r}): {why}; the model's "
                          f"{len(names)} parameters are named like {sample} (a 'match' glob such as "
                          "'*.bias', or a 'regex' searched in the name)")
