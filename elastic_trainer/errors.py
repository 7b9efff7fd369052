"""Exceptions users can catch. Each message names what was given and what would fit."""


class ElasticTrainerError(Exception):
    """Base class for every error elastic_trainer raises on purpose."""


class ConfigError(ElasticTrainerError, ValueError):
    """The configuration is invalid; raised before any worker starts."""


class DataError(ElasticTrainerError):
    """The training data is missing, empty, corrupt or of the wrong shape."""


class ModelError(ElasticTrainerError):
    """The model factory could not be imported or returned something unusable."""


class PlacementError(ElasticTrainerError):
    """The cluster could not host the requested workers within the wait allowed."""


class WorkerError(ElasticTrainerError):
    """A worker failed during set-up or a training step."""


class RunError(ElasticTrainerError):
    """The run stopped: too many failures, too few workers for too long, or no copy of the state left."""


def error_line(e: BaseException, limit: int = 200) -> str:
    """``Type: first line of its message`` (the type alone for an empty message): how a log line
    or a failure's detail names an error whose traceback would drown the rest. A remote task's
    error (Ray's ``RayTaskError``, whose own first line is only where it ran) is named by its cause."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and type(e).__name__.startswith("RayTaskError"):
        e = cause
    text = str(e).splitlines()[0][:limit] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
