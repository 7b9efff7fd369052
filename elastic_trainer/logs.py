"""Logging of the controller and worker actors.

Both log through the standard ``logging`` module under the ``elastic_trainer``
logger, every record prefixed with the run's name (``[run] ...``). Ray writes
an actor's stderr to its log file, which the dashboard shows, and forwards it
to the driver, so a handler on stderr is all an actor needs.
"""

from __future__ import annotations

import logging
import os
import sys

from .secrets import mask

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _MaskingFormatter(logging.Formatter):
    """Every line with its secrets masked (``secrets.mask``): an actor's log file is readable by
    whoever reads the node's Ray logs, and Ray forwards it to the driver."""

    def format(self, record: logging.LogRecord) -> str:
        return mask(super().format(record))


def configure_actor_logging() -> None:
    """Give the ``elastic_trainer`` logger a stderr handler in this process, once.

    ``ELASTIC_TRAINER_LOG_LEVEL`` sets the level (default INFO). A process whose
    logger already has a handler (a user's own set-up) is left as it is.
    """
    logger = logging.getLogger("elastic_trainer")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_MaskingFormatter(_FORMAT))
    logger.addHandler(handler)
    level = os.environ.get("ELASTIC_TRAINER_LOG_LEVEL", "INFO").upper()
    logger.setLevel(level if isinstance(logging.getLevelName(level), int) else "INFO")
    # The driver's root handlers (if any) must not print every actor record twice.
    logger.propagate = False
