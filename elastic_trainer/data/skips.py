"""Sample ranges a run never reads, and where each step's batch then starts.

A run's data is one global order of samples (``data.sampler``); step ``s`` reads the
``global_batch_size`` samples after the cursor. Ranges of that order can be left out: given in
the config (``data.skip_samples``), or by the run itself when a step was judged anomalous
(``integrity.on_anomaly``: ``skip`` leaves out the step's batch and runs the step again on the
next one, ``rollback`` the batches since the snapshot it returns to). Every range is whole
batches, so a batch never straddles one: step ``s`` reads ``[cursor(s), cursor(s) + B)``.

Pure: no torch, no Ray.
"""

from __future__ import annotations

from ..config.sample_ranges import add_range, check_ranges  # noqa: F401 - the ranges' rules, with their use


def position(index: int, ranges) -> int:
    """Where the ``index``-th sample read sits in the global order, past the skipped ranges."""
    p = index
    for a, b in ranges:
        if p < a:
            break
        p += b - a
    return p


def cursor(step: int, global_batch: int, ranges) -> int:
    """The first sample of step ``step`` (counted from 1)."""
    return position((step - 1) * global_batch, ranges)
