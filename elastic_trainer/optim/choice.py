"""Which optimizer class a run steps with, and what the rest of the system needs to know of it.

``train.optimizer.name`` is a ``torch.optim`` class by name (``"SGD"``, ``"AdamW"``,
``"Adafactor"``, ...) or a user's class by import path (``"package.module:Class"`` or
``"package.module.Class"``). Everything here takes plain values, not config sections, so the
config's own checks can call it (``check_spec``) without importing the config back.

Elementwise: an optimizer whose update of an element reads only that element's gradient,
state and hyper-parameters (Adam, SGD, ...). Only those run sharded over a DP group
(``parallel.shard_optimizer``): a rank that steps a slice of a parameter updates it as a
whole-tensor step would. A user class says so with a class attribute ``elementwise = True``.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from ..errors import ConfigError

# torch.optim classes whose update is elementwise (the sharded path relies on it): each keeps
# only tensors of the parameter's shape and scalar counters. Adafactor is not (factored row and
# column statistics, and its step is scaled by the parameter's RMS), nor Muon (orthogonalises
# whole matrices).
ELEMENTWISE = frozenset({"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
                         "Adadelta", "ASGD", "Rprop"})
# torch.optim classes a training step cannot drive, and why.
REFUSED = {
    "LBFGS": "it needs a closure that re-evaluates the model several times a step, which a pipeline "
             "step does not have",
    "SparseAdam": "it takes sparse gradients only, and the gradients here are dense",
    "Optimizer": "it is the base class, with no update of its own",
    "Muon": "it takes 2-D parameters only, and one optimizer steps all of a model's parameters here, its "
            "1-D biases and norms too",
}
# Arguments of the config that the step sets itself, not the optimizer's kwargs.
_NOT_KWARGS = {"params": "the parameters come from the model",
               "lr": "train.lr is the rate the schedule (train.lr_schedule) scales each step"}
# Keys of a param group that are not the optimizer's arguments.
PATTERN_KEYS = ("match", "regex")


def resolve(name: str) -> type:
    """The optimizer class ``name`` names (see the module docstring); ConfigError if none."""
    import torch

    if ":" not in name and "." not in name:
        cls = getattr(torch.optim, name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ConfigError(f"train.optimizer.name({name!r}) is not a torch.optim optimizer; "
                              f"torch.optim has {', '.join(torch_names())}, or give a class of your own "
                              "as 'package.module:Class'")
    else:
        module_name, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # ImportError, or any error raised while importing
            raise ConfigError(f"train.optimizer.name({name!r}): cannot import {module_name!r}: {e}") from None
        cls = getattr(module, attr, None)
        if not isinstance(cls, type):
            raise ConfigError(f"train.optimizer.name({name!r}): module {module_name!r} has no class {attr!r}")
        if not issubclass(cls, torch.optim.Optimizer):
            raise ConfigError(f"train.optimizer.name({name!r}) is not a torch.optim.Optimizer subclass "
                              f"(its bases: {[b.__name__ for b in cls.__mro__[1:]]})")
    if cls.__name__ in REFUSED and cls.__module__.startswith("torch.optim"):
        raise ConfigError(f"train.optimizer.name({name!r}) cannot be used: {REFUSED[cls.__name__]}")
    return cls


def torch_names() -> list[str]:
    """The ``torch.optim`` optimizers a run may name."""
    import torch

    return sorted(n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                  and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n not in REFUSED)


def is_elementwise(cls: type) -> bool:
    """Whether ``cls``'s update is elementwise (see the module docstring)."""
    if cls.__module__.startswith("torch.optim") and cls.__name__ in ELEMENTWISE:
        return True
    return getattr(cls, "elementwise", False) is True


def arguments(cls: type) -> dict[str, inspect.Parameter]:
    """The keyword arguments ``cls.__init__`` takes (``params`` left out); None-keyed ``**`` as ``"**"``."""
    out = {}
    for n, p in inspect.signature(cls.__init__).parameters.items():
        if n in ("self", "params") or p.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        out["**" if p.kind is inspect.Parameter.VAR_KEYWORD else n] = p
    return out


def check_kwargs(cls: type, kwargs: dict[str, Any], where: str) -> None:
    """ConfigError naming ``where`` (the config key) unless ``cls`` takes every key of ``kwargs``."""
    takes = arguments(cls)
    for k in kwargs:
        if k in _NOT_KWARGS:
            raise ConfigError(f"{where} sets {k!r}, which is not the optimizer's to set here: {_NOT_KWARGS[k]}")
    if "**" in takes:
        return
    bad = sorted(k for k in kwargs if k not in takes)
    if bad:
        raise ConfigError(f"{where}: {cls.__name__} takes no {', '.join(repr(k) for k in bad)}; it takes "
                          f"{', '.join(k for k in takes if k != 'lr')}")


def check_spec(name: str, kwargs: dict, groups: list[dict], legacy: dict, sharded: str) -> type:
    """Check a ``train.optimizer`` section against its class: the name resolves, the kwargs and each
    group's overrides are arguments of the class, every group has one pattern, the AdamW fields of
    ``train`` (``legacy``: the ones given other than their defaults) fit, and an explicit
    ``parallel.shard_optimizer`` (``sharded``) shards only an elementwise class. Returns the class."""
    import re

    cls = resolve(name)
    check_kwargs(cls, kwargs, "train.optimizer.kwargs")
    for i, g in enumerate(groups):
        where = f"train.optimizer.param_groups[{i}]"
        pats = [k for k in PATTERN_KEYS if k in g]
        if len(pats) != 1:
            raise ConfigError(f"{where} needs one of 'match' (a glob on the global parameter name, e.g. "
                              f"'*.bias') or 'regex' (a regular expression searched in it); given keys {sorted(g)}")
        if not isinstance(g[pats[0]], str) or not g[pats[0]]:
            raise ConfigError(f"{where}.{pats[0]}({g[pats[0]]!r}) must be a non-empty string")
        if "regex" in g:
            try:
                re.compile(g["regex"])
            except re.error as e:
                raise ConfigError(f"{where}.regex({g['regex']!r}) is not a regular expression: {e}") from None
        over = {k: v for k, v in g.items() if k not in PATTERN_KEYS and k != "lr"}
        check_kwargs(cls, over, where)
        if "lr" in g and not (isinstance(g["lr"], (int, float)) and g["lr"] > 0):
            raise ConfigError(f"{where}.lr({g['lr']!r}) must be a positive number (the group's peak rate, "
                              "scaled by the schedule as train.lr is)")
    takes = arguments(cls)
    for k, v in legacy.items():
        if k in kwargs:
            raise ConfigError(f"train.{k}({v!r}) and train.optimizer.kwargs.{k}({kwargs[k]!r}) both given; set one")
        if k not in takes and "**" not in takes:
            raise ConfigError(f"train.{k}({v!r}) is an argument {cls.__name__} does not take; it takes "
                              f"{', '.join(t for t in takes if t != 'lr')}")
    if sharded in ("optimizer", "gradients") and not is_elementwise(cls):
        why = ("its state and step are per row / column or per tensor" if cls.__name__ == "Adafactor"
               else "it does not declare elementwise = True")
        raise ConfigError(
            f"parallel.shard_optimizer({sharded!r}) steps each rank's slice of a parameter on its own, "
            f"which is exact only for an elementwise update; {cls.__name__}'s is not "
            f"({why}): "
            "use shard_optimizer 'none' or 'auto' (auto does not shard it)")
    return cls


def try_build(cls: type, kwargs: dict, groups: list[dict], lr: float) -> None:
    """Make ``cls`` once over one-element tensors with these arguments (one tensor per group), so
    values it refuses (a negative momentum, say) are a ConfigError when the config is loaded."""
    import torch

    made = [{"params": [torch.zeros(1, requires_grad=True)]}]
    made += [{"params": [torch.zeros(1, requires_grad=True)], **{k: v for k, v in g.items() if k not in PATTERN_KEYS}}
             for g in groups]
    try:
        cls(made, lr=lr, **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the class raises for its arguments
        args = ", ".join([f"lr={lr}"] + [f"{k}={v!r}" for k, v in kwargs.items()])
        raise ConfigError(f"train.optimizer: {cls.__name__}({args}) with param_groups {groups} refused its "
                          f"arguments: {type(e).__name__}: {e}") from None


def state_floats(name: str, kwargs: dict) -> float:
    """Floats of state the optimizer keeps per parameter element (scalar counters left out);
    a user class may say with a class attribute ``state_floats``; else 2, as AdamW."""
    try:
        cls = resolve(name)
    except ConfigError:
        return 2.0
    own = getattr(cls, "state_floats", None)
    if isinstance(own, (int, float)):
        return float(own)
    n = cls.__name__ if cls.__module__.startswith("torch.optim") else None
    if n == "SGD":
        return 1.0 if kwargs.get("momentum", 0) else 0.0
    if n in ("Adam", "AdamW"):
        return 3.0 if kwargs.get("amsgrad") else 2.0
    if n == "RMSprop":
        return 1.0 + bool(kwargs.get("momentum", 0)) + bool(kwargs.get("centered"))
    if n in ("Adagrad", "ASGD"):
        return 1.0
    if n == "Adafactor":
        return 0.0   # a row and a column per matrix: negligible beside the matrix
    return 2.0
