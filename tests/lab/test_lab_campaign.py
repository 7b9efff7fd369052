"""The fault campaign on lab hosts (``lab.campaign``): a worker's host killed for memory by the
kernel, then a host cut off during that recovery's restore, on hosts in network namespaces; the
campaign's driver on the head host, the checker holding the run to the failure-free one's, and
nothing of the lab or the run left behind. The long form is ``benchmarks/campaign.py --lab``."""

import dataclasses

import pytest

from elastic_trainer.chaos.campaign.campaign import Setting
from elastic_trainer.chaos.campaign.schedule import Fault, Schedule

from lab import missing
from lab.campaign import run_lab_campaign

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def test_a_memory_kill_then_a_cut_during_its_restore_lose_nothing(tmp_path):
    why = missing()
    if why:
        pytest.skip(why)
    setting = Setting(steps=12, durable_every=4)
    schedule = Schedule([Fault("memory_kill", "between_steps", 3, rank=3),
                         Fault("cut", "restore", 1, rank=0, seconds=2.0)])
    lines: list[str] = []
    doc = run_lab_campaign({"setting": dataclasses.asdict(setting), "schedules": [schedule.to_json()],
                            "shrink": False}, tmp_path, say=lines.append)
    print("\n".join(lines))
    [run] = doc["runs"]
    assert not run["violations"] and doc["violations"] == 0, run["violations"]
    assert run["state"] == "FINISHED" and not run["unstruck"], run
    memory, cut = run["struck"]
    # The kernel's OOM killer ended the run's worker on that host (Ray marks workers first to go).
    assert memory["done"] == "memory killed" and memory["pid"] in memory["pids_gone"], memory
    assert cut["done"] == "link cut" and cut["point"] == "restore", cut
    assert not doc["lab_leftovers"], doc["lab_leftovers"]
    assert doc["summary"].startswith("schedules 1, violations 0"), doc["summary"]
