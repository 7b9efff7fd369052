"""elastic_trainer: hybrid data + pipeline parallel training on Ray that keeps going when nodes die."""

from .config import TrainerConfig
from .errors import ConfigError, DataError, ElasticTrainerError, ModelError, PlacementError, RunError, WorkerError

__all__ = [
    "Trainer", "TrainerConfig", "Result", "Run", "StepRecord", "Event", "Checkpoint",
    "ElasticTrainerError", "ConfigError", "DataError", "ModelError", "PlacementError", "RunError", "WorkerError",
]


def __getattr__(name):
    # Trainer pulls in Ray; import it only when asked so config-only use stays light.
    if name == "Trainer":
        from . import trainer
        return trainer.Trainer
    if name == "Run":
        from . import run_handle
        return run_handle.Run
    if name in ("Result", "StepRecord", "Event", "Checkpoint"):
        from . import results
        return getattr(results, name)
    raise AttributeError(name)
