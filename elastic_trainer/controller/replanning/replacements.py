"""Replacements: asking Ray's autoscaler for the workers the run is short of.

After a loss, a drain, or a start on a cluster with too little room, the run has fewer workers
than ``scaling.max_workers`` (those on draining nodes do not count: they are leaving). Left
alone, it waits for a node to join by chance. Where the cluster has an autoscaler, asking for
resources (``ray.autoscaler.sdk.request_resources`` with one bundle per worker, the shape of
``scaling.resources_per_worker``) makes it start nodes for them; the live grow takes them in as
for any node that joins. The request is for the whole run (the autoscaler counts what already
runs against it), so the missing workers are what it adds. It is withdrawn once the run is
whole again, and when the run ends. Where the cluster has no autoscaler the request is a key
in the GCS that nothing reads: harmless.

Ray keeps one such request per cluster: two runs on one cluster asking at once overwrite each
other's (docs/runtime.md "Replacements").
"""

from __future__ import annotations

import logging

from ...config import TrainerConfig
from ..run.run_record import RunRecord
from ..run.workers import WorkerPool

log = logging.getLogger(__name__)


def _request_resources(bundles: list[dict]) -> None:
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)


def worker_bundle(cfg: TrainerConfig) -> dict:
    """One worker's resources, as the autoscaler reads a bundle."""
    return {k: float(v) for k, v in cfg.scaling.resources_per_worker.items() if v}


class Replacements:
    """Keeps the autoscaler's request in step with what the run is short of (``update``)."""

    def __init__(self, cfg: TrainerConfig, run: RunRecord, pool: WorkerPool, request=_request_resources):
        self.cfg, self.run, self.pool, self._request = cfg, run, pool, request
        self.asked = 0          # bundles asked for now (0: no request standing)
        self._failed = False    # said once that asking failed

    def short(self) -> int:
        """Workers the run lacks: ``max_workers`` less those that stay (not on a draining node)
        and those starting."""
        return max(0, self.cfg.max_workers - self.pool.staying() - len(self.pool.joining))

    def update(self, room: int | None = None) -> None:
        """Ask for the run's workers while it is short of some (``room``: at the start, the
        workers the cluster has room for now), withdraw the request once it is whole."""
        short = (self.cfg.max_workers - room) if room is not None else self.short()
        if short > 0 and not self.asked:
            self._ask(self.cfg.max_workers, short)
        elif short <= 0 and self.asked:
            self.withdraw()

    def withdraw(self) -> None:
        """Withdraw the request (the run is whole again, or ends)."""
        if self.asked:
            self._ask(0, 0)

    def _ask(self, bundles: int, short: int) -> None:
        try:
            self._request([worker_bundle(self.cfg)] * bundles)
        except Exception as e:  # noqa: BLE001 - asking for capacity must never end the run
            if not self._failed:
                log.warning("[%s] could not ask the autoscaler for workers (%s: %s); the run takes nodes as "
                            "they join", self.run.name, type(e).__name__, e)
                self._failed = True
            return
        action = "requested" if bundles else "withdrawn"
        self.asked = bundles
        if bundles:
            log.info("[%s] %d worker(s) short: asked the autoscaler for %d x %s", self.run.name, short, bundles,
                     worker_bundle(self.cfg))
        self.run.event("replacements", action=action, short=short, bundles=bundles, step=self.run.step)
