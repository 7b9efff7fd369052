"""Names of the actors a run starts, in one Ray namespace.

Actors live in a fixed namespace rather than the job's anonymous one, so that
another driver (``elastic-trainer status``, a test, the recovery benchmark)
finds a run's controller by name, and the Ray dashboard's Actors view lists
each one by run, rank, replica and stage.
"""

NAMESPACE = "elastic_trainer"


def controller_name(run: str) -> str:
    return f"{run}-controller"


def worker_name(run: str, rank: int, replica: int, stage: int) -> str:
    """A worker's name carries the coordinates of the rank it started as; after a
    re-plan its current rank is in the controller's status."""
    return f"{run}-rank{rank}-r{replica}s{stage}"


def spare_name(run: str, worker_id: int) -> str:
    """A worker started later (a replacement or a new node), before it has a rank."""
    return f"{run}-w{worker_id}"


def is_controller(name: str) -> bool:
    return name.endswith("-controller")
