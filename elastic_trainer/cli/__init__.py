"""The ``elastic-trainer`` command: ``commands`` (run, plan, bench-comm, status, stop,
prepare-data, export; campaign in ``campaign_cmd``) and ``status`` (the live runs on a cluster, through their controllers)."""


def main(argv=None) -> int:
    """``elastic-trainer``: see ``commands.main``."""
    import os
    import sys

    # As under `python -m elastic_trainer`: a `model.factory` module beside the job file imports.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    from .commands import main as run

    return run(argv)
