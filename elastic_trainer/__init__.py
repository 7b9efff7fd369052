"""elastic_trainer: hybrid data + pipeline parallel training on Ray that keeps going when nodes die."""

from .config import TrainerConfig
from .errors import ConfigError, DataError, ElasticTrainerError, ModelError, PlacementError, RunError, WorkerError

__all__ = [
    "Trainer", "TrainerConfig", "Result",
    "ElasticTrainerError", "ConfigError", "DataError", "ModelError", "PlacementError", "RunError", "WorkerError",
]


def __getattr__(name):
    # Trainer pulls in Ray; import it only when asked so config-only use stays light.
    if name in ("Trainer", "Result"):
        from . import trainer
        return getattr(trainer, name)
    raise AttributeError(name)
