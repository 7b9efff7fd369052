"""Each step's per-rank figures, kept apart from the step's record.

A step record goes to the driver, into every durable checkpoint's manifest and
into ``result.history``; a figure per rank per step there grows as ranks x
steps (at 1,000 ranks, tens of kilobytes a step). So ``balance.observe``'s
per-rank figures (``RANK_FIELDS``) leave the record when the step commits: the
controller keeps the last ``KEEP`` steps of them for the driver to fetch, the
driver appends them to ``<run.report_dir>/<run>.ranks.jsonl``, and the metrics
and ``status`` read the newest.
"""

from __future__ import annotations

import collections

# What balance.observe adds to a step's record, one value per rank (keys are str(rank)), and each
# rank's peak resident memory in the step (worker.memory_use).
RANK_FIELDS = ("rank_compute_s", "rank_wait_s", "pace", "rank_peak_rss_bytes", "rank_peak_device_bytes")
# Steps kept for a driver that polls late: about a minute of 10 ms steps.
KEEP = 4096


def split_rank_figures(record: dict) -> dict:
    """Take the per-rank figures out of ``record``: ``{"step": ..., field: {rank: value}}``."""
    figures = {"step": record["step"]}
    for field in RANK_FIELDS:
        if field in record:
            figures[field] = record.pop(field)
    return figures


class RankFigures:
    """The newest ``KEEP`` steps' per-rank figures, numbered from the run's start so a reader
    asks for what it has not seen (``since``); older ones are gone from here, and only from here."""

    def __init__(self, keep: int = KEEP):
        self._kept: collections.deque[dict] = collections.deque(maxlen=keep)
        self.count = 0   # figures appended since the run started

    def append(self, figures: dict) -> None:
        self._kept.append(figures)
        self.count += 1

    def since(self, seen: int) -> tuple[list[dict], int]:
        """The figures after the first ``seen``, and how many were dropped unread before them."""
        first = self.count - len(self._kept)   # the number of the oldest kept
        start = max(seen, first)
        return list(self._kept)[start - first:], start - seen

    def last(self) -> dict:
        return self._kept[-1] if self._kept else {}
