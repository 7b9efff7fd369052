"""The ``elastic-trainer`` command: ``commands`` (run, plan, bench-comm, status, stop,
prepare-data, export) and ``status`` (the live runs on a cluster, through their controllers)."""


def main(argv=None) -> int:
    """``elastic-trainer``: see ``commands.main``."""
    from .commands import main as run

    return run(argv)
