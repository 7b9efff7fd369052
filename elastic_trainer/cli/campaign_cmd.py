"""``elastic-trainer campaign``: a seeded fault campaign over the real runtime, on a simulated
cluster of this machine, with the checker (``chaos.campaign``)."""

from __future__ import annotations


def add_parser(sub) -> None:
    c = sub.add_parser("campaign", help="Run seeded fault schedules against real runs on a simulated cluster and "
                                        "check that nothing is lost.",
                       description="Each schedule strikes faults (process and node kills, freezes, joins, storage "
                                   "outages) at named points of a run (a step, a snapshot in flight, a set-up, a "
                                   "restore, a durable write, the final save, a grow, a fenced worker) and the "
                                   "checker holds what the run left to the failure-free run's. A failing schedule "
                                   "is shrunk and printed as a command that replays it. Ends with 'schedules N, "
                                   "violations V'; exits 1 on any violation. On lab hosts (network namespaces: "
                                   "cut links, kernel memory kills), from a checkout: python benchmarks/campaign.py "
                                   "--lab.")
    c.add_argument("--schedules", type=int, default=10, help="how many schedules (default 10: the seeds that "
                                                             "cover every fault kind and point first)")
    c.add_argument("--seed", type=int, default=0, help="the first seed (default 0)")
    c.add_argument("--replay", metavar="JSON", help="run this one schedule (as a failing one is printed)")
    c.add_argument("--steps", type=int, default=24, help="steps of each run (default 24)")
    c.add_argument("--dp", type=int, default=2)
    c.add_argument("--pp", type=int, default=2)
    c.add_argument("--no-shrink", action="store_true", help="report failing schedules as they are")
    c.add_argument("--json", metavar="FILE", help="also write every schedule's outcome and the coverage here")
    c.set_defaults(fn=cmd_campaign)


def cmd_campaign(args) -> int:
    from ..chaos.campaign.campaign import Setting, coverage, coverage_line, draws, run_campaign, write_json
    from ..chaos.campaign.schedule import Schedule

    setting = Setting(steps=args.steps, dp=args.dp, pp=args.pp)
    schedules = [Schedule.from_json(args.replay)] if args.replay else draws(args.schedules, setting, args.seed)
    reports = run_campaign(schedules, setting, shrink_failures=not args.no_shrink)
    print(coverage_line(coverage(reports)))
    if args.json:
        write_json(args.json, reports)
    return 1 if any(r.violations for r in reports) else 0
