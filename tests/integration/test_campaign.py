"""The short fault campaign CI runs: the fewest seeds whose schedules strike every fault kind at
every named point (and meet both optimizer-state layouts), on the real runtime, each run held
to the checker's invariants (elastic_trainer.chaos.campaign; the long form is
benchmarks/campaign.py)."""

import pytest

from elastic_trainer.chaos.campaign.campaign import Campaign, Setting, coverage, run_campaign
from elastic_trainer.chaos.campaign.schedule import KINDS, covering
from elastic_trainer.controller.run.fault_points import POINTS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def test_a_short_campaign_strikes_every_fault_kind_at_every_point_and_nothing_is_lost(fresh_cluster):
    setting = Setting(steps=16, durable_every=4)
    c, nodes = fresh_cluster(setting.world + setting.spares)
    schedules = covering(setting.steps, setting.world, setting.durable_every)
    with Campaign(setting, cluster=c, nodes=list(nodes)) as camp:
        reports = run_campaign(schedules, setting, shrink_failures=False, campaign=camp)
    cov = coverage(reports)
    print("coverage:", cov)
    violations = [f"seed {r.schedule.seed} ({r.schedule.describe()}): {v}" for r in reports for v in r.violations]
    assert not violations, "\n".join(violations)
    # Every fault was struck where it was drawn: none waited at a point the run never reached.
    assert not [r.outcome.unstruck for r in reports if r.outcome.unstruck]
    assert set(cov["kinds"]) == set(KINDS) and set(cov["points"]) == set(POINTS)
