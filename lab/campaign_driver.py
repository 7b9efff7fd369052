"""The fault campaign's driver on the lab's head host: ``python -m lab.campaign_driver OUT_DIR``.

Started by ``lab.campaign.run_lab_campaign``, which wrote ``OUT_DIR/args.json`` (the setting,
the schedules, whether to shrink). It runs the campaign as on the simulated cluster, the runs
being the product's own on the lab's Ray cluster, their storage an S3 server on the head's
address; a process kill and a storage outage it strikes itself, a host's fault (kill, freeze,
cut, memory kill, join) it asks of the lab's owner (``lab.channel``). Each schedule's line goes
to ``OUT_DIR/lines.txt``, the outcomes and the coverage to ``OUT_DIR/report.json``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import ray

from elastic_trainer.chaos.campaign.campaign import Campaign, Setting, run_campaign, write_json
from elastic_trainer.chaos.campaign.schedule import Schedule
from elastic_trainer.chaos.campaign.strike import Striker, victim_of, wait_until

from .channel import Channel

HOST_FAULTS = ("kill_node", "freeze", "cut", "memory_kill")
# A lab host has a fraction of a core: starting a worker there takes seconds, not the
# simulated cluster's one; a step's collectives cross real (virtual) links.
LAB_TIMEOUTS = {"startup_timeout_s": 60, "min_step_timeout_s": 5, "rendezvous_timeout_s": 20, "wait_for_nodes_s": 2}


class LabStriker(Striker):
    """Strikes a process kill and a storage outage here, a host's fault through the lab's owner."""

    def __init__(self, channel: Channel, s3=None):
        super().__init__(None, [], s3)
        self.channel = channel

    def strike(self, fault, held: dict, workers: list[dict]) -> dict:
        if fault.kind == "join":
            return self.channel.call("join")
        if fault.kind not in HOST_FAULTS:
            return super().strike(fault, held, workers)
        victim = victim_of(fault.rank, held, workers)
        if victim is None:
            return {"done": "skipped", "why": f"no worker holds rank {fault.rank} now"}
        address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}.get(victim["node_id"])
        out = {"worker": victim["worker_id"], "rank": victim.get("rank"), "node": victim["node_id"],
               "pid": victim["pid"], "host": address}
        return {**out, **self.channel.call("strike", kind=fault.kind, address=address, seconds=fault.seconds)}

    def _at_deadline(self, seconds: float, victim: dict) -> None:
        """The drained host is killed whole at its deadline, by the lab's owner."""
        address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}.get(victim["node_id"])
        self.channel.call("strike", kind="drain", address=address, seconds=seconds)

    def settle(self) -> None:
        super().settle()
        self.channel.call("settle")

    def pending(self) -> bool:
        return super().pending() or self.channel.call("pending")["pending"]


@dataclass
class LabCampaign(Campaign):
    """A campaign on the lab's cluster (this process is on its head host), its hosts made whole
    by the lab's owner between schedules."""

    channel: Channel | None = None

    def __enter__(self) -> "LabCampaign":
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR")
        self.owns_ray = False
        self.prepare(s3_host=ray.util.get_node_ip_address())
        self.top_up()
        return self

    def __exit__(self, *exc) -> None:
        if self.s3 is not None:
            self.s3.stop()
        ray.shutdown()
        self.cleanup()

    def top_up(self) -> None:
        self.channel.call("top_up")
        want = self.setting.world + self.setting.spares
        wait_until(lambda: sum(1 for n in ray.nodes() if n["Alive"]) == want + 1
                   and ray.available_resources().get("CPU", 0) == want, 60.0, every_s=0.2)

    def striker(self) -> Striker:
        return LabStriker(self.channel, self.s3)


def main(out_dir: str) -> int:
    out = Path(out_dir)
    args = json.loads((out / "args.json").read_text())
    setting = Setting(**args["setting"])
    schedules = [Schedule.from_json(s) for s in args["schedules"]]
    lines = open(out / "lines.txt", "a", buffering=1)
    camp = LabCampaign(setting, timeouts=LAB_TIMEOUTS, deadline_s=args.get("deadline_s", 600.0),
                       channel=Channel(out / "channel"))
    with camp:
        reports = run_campaign(schedules, setting, shrink_failures=args.get("shrink", True),
                               out=lambda line: lines.write(line + "\n"), campaign=camp)
    write_json(str(out / "report.json"), reports)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
