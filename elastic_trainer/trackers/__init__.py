"""Experiment trackers on the driver: a run's curves, events and config in TensorBoard and MLflow.

::

    trackers = open_trackers(cfg, run_name)   # run.trackers; none configured: a no-op
    trackers.step(rec)                        # each step record the driver sees
    trackers.event(ev)                        # each event
    trackers.close(state, goodput)            # "FINISHED" / "STOPPED" / "FAILED", the goodput report

A tracker whose package is missing fails ``check_trackers`` (and ``open_trackers``) with a
``ConfigError`` naming the pip extra. Once open, a tracker never fails the run: the first error
it raises (at its start or any write) is said once on stderr, and it writes nothing more.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping

from ..config import TrainerConfig
from ..errors import ConfigError, error_line
from ..storage.uris import mask
from .records import REQUIRED, STEP_KEYS  # noqa: F401  (the record keys a tracker reads)

# tracker -> the modules it imports (the ``trackers`` extra installs them).
_NEEDS = {"tensorboard": ("tensorboard",), "mlflow": ("mlflow",)}
# URI schemes MLflow serves from a database through SQLAlchemy (and its migrations through Alembic).
_DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
EXTRA = "pip install 'elastic_trainer[trackers]'"


def check_trackers(cfg: TrainerConfig) -> None:
    """Raise ``ConfigError`` where ``run.trackers`` names a tracker whose packages are not installed."""
    for name in dict.fromkeys(cfg.run.trackers):
        missing = [m for m in _NEEDS[name] if not _installed(m)]
        if name == "mlflow" and not missing:
            from .mlflow_writer import tracking_uri

            uri = tracking_uri(cfg)
            if uri.split(":", 1)[0].split("+", 1)[0] in _DB_SCHEMES:
                missing = [m for m in ("sqlalchemy", "alembic") if not _installed(m)]
                if missing:
                    raise ConfigError(f"run.trackers has 'mlflow', whose tracking URI {mask(uri)!r} is a database "
                                      f"store that needs {' and '.join(missing)}, not installed: {EXTRA}")
        if missing:
            raise ConfigError(f"run.trackers has {name!r}, but {' and '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} not installed: {EXTRA}")


class Trackers:
    """The run's open trackers, each written in turn; with none, every call does nothing.

    ``where``: a line per open tracker saying where it writes (secrets masked)."""

    def __init__(self, trackers: list | None = None):
        self._open = list(trackers or [])
        self.where = [t.where for t in self._open]

    def __bool__(self) -> bool:
        return bool(self._open)

    def step(self, rec: Mapping) -> None:
        """Write one step record, a dict or any mapping (a step written again after a rollback
        replaces the first)."""
        if self._open:
            self._each("step", dict(rec))

    def event(self, ev: Mapping) -> None:
        """Write one event (``kind``, ``time``, its fields; a dict or any mapping) as text, and
        count it where it is trouble."""
        if self._open:
            self._each("event", dict(ev))

    def flush(self) -> None:
        """Send what is buffered now."""
        self._each("flush")

    def close(self, state: str, goodput: Mapping | None = None) -> None:
        """Write the run's end (``state``, the goodput report) and close every tracker."""
        self._each("close", str(getattr(state, "value", state)), dict(goodput) if goodput else None)
        self._open = []

    def _each(self, method: str, *args) -> None:
        for t in list(self._open):
            try:
                getattr(t, method)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker's trouble never fails the run
                self._open.remove(t)
                _warn(t.name, f"failed to write ({mask(error_line(e))})")


def open_trackers(cfg: TrainerConfig, run_name: str) -> Trackers:
    """The trackers ``cfg.run.trackers`` asks for, open on the run ``run_name``: its config written
    as parameters. One that cannot start is said once on stderr and left out; a missing package is
    a ``ConfigError`` (``check_trackers``)."""
    check_trackers(cfg)
    opened = []
    for name in dict.fromkeys(cfg.run.trackers):
        try:
            opened.append(_open_one(name, cfg, run_name))
        except Exception as e:  # noqa: BLE001 - the run goes on without it
            _warn(name, f"could not start ({mask(error_line(e))})")
    return Trackers(opened)


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported (one set to None in ``sys.modules`` is blocked, as import takes it)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def _open_one(name: str, cfg: TrainerConfig, run_name: str):
    if name == "tensorboard":
        from .tensorboard_writer import TensorBoardTracker

        return TensorBoardTracker(cfg, run_name)
    from .mlflow_writer import MlflowTracker

    return MlflowTracker(cfg, run_name)


def _warn(name: str, what: str) -> None:
    print(f"warning: tracker {name} {what}; the run goes on without it", file=sys.stderr, flush=True)
