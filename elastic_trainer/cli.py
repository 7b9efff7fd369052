"""Command line: ``elastic-trainer run | plan | status | prepare-data``."""

from __future__ import annotations

import argparse
import json
import sys

from .config import TrainerConfig
from .errors import ConfigError, ElasticTrainerError


def _cmd_run(args) -> int:
    from .trainer import Trainer

    cfg = TrainerConfig.from_yaml(args.job, args.set)
    if args.kill_node_at_step is not None and not args.simulate_nodes:
        raise ConfigError("--kill-node-at-step needs --simulate-nodes N (a local multi-node cluster to kill a node of)")
    if args.simulate_nodes:
        import time

        from .simulate import simulated_cluster

        if cfg.run.name is None:  # the killer finds the run's controller by name
            cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": time.strftime("et-%Y%m%d-%H%M%S")})})

        with simulated_cluster(args.simulate_nodes, cfg) as sim:
            result = Trainer(cfg, on_step=sim.killer(args.kill_node_at_step)).fit(resume=args.resume)
    else:
        result = Trainer(cfg).fit(resume=args.resume)
    print(f"run {result.run_name}: final loss {result.final_loss:.4f} after {len(result.history)} steps"
          + (f", {len(result.failures)} failure(s) survived" if result.failures else ""))
    return 0


def _cmd_plan(args) -> int:
    from .controller.plan import make_plan

    cfg = TrainerConfig.from_yaml(args.job, args.set)
    plan = make_plan(cfg)
    out = plan.describe()
    out.pop("rank_nodes")
    out["micro_batches_per_replica"] = cfg.micro_batches
    out["schedule"] = cfg.parallel.schedule
    out["backend"] = cfg.scaling.resolved_backend()
    print(json.dumps(out, indent=2))
    return 0


def _check_reachable(address: str) -> None:
    """Fail in seconds on a wrong host:port; Ray itself retries it for a minute."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto" and other forms: Ray resolves them itself, quickly
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except OSError as e:
        raise ElasticTrainerError(f"no Ray cluster answers at --address {address!r} ({e.strerror or e})") from None


def _cmd_status(args) -> int:
    import os

    import ray

    from .naming import NAMESPACE
    from .status import format_status, live_statuses

    address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
    _check_reachable(address)
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    except ConnectionError as e:
        raise ElasticTrainerError(f"no Ray cluster at --address {address!r}: {e}") from None
    try:
        statuses = live_statuses(args.run)
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(statuses, indent=2, default=str))
    elif not statuses:
        print("no live runs" + (f" named {args.run!r}" if args.run else "") + f" on {address}")
    else:
        print("\n\n".join(format_status(st) for st in statuses))
    return 0


def _cmd_prepare(args) -> int:
    from .data.corpus import prepare_stdlib_corpus

    rows = prepare_stdlib_corpus(args.out, args.seq_len, int(args.max_mb * (1 << 20)))
    print(f"wrote {rows} rows of {args.seq_len + 1} byte tokens to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-trainer",
        description="Train models with data + pipeline parallelism on a Ray cluster.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def job_command(name: str, help: str):
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("job", help="YAML job file, e.g. jobs/demo.yaml")
        p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a config value (repeatable), e.g. --set train.steps=50")
        return p

    run = job_command("run", "Run a training job.")
    run.add_argument("--resume", action="store_true",
                     help="continue from the newest durable checkpoint in checkpoint.storage")
    run.add_argument("--simulate-nodes", type=int, metavar="N",
                     help="start a local cluster of N simulated nodes (one machine) and run on it")
    run.add_argument("--kill-node-at-step", type=int, metavar="K",
                     help="with --simulate-nodes: kill (SIGKILL) the node of the last rank once step K is done")
    run.set_defaults(fn=_cmd_run)
    job_command("plan", "Print the plan (topology, stage cut) a job would use, without running it.").set_defaults(
        fn=_cmd_plan)
    st = sub.add_parser("status", help="Show the live runs on a cluster: plan, step, throughput, failures.",
                        description="Show the live runs on a Ray cluster, read from their controllers.")
    st.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else the local cluster)")
    st.add_argument("--run", help="only this run")
    st.add_argument("--json", action="store_true", help="print the raw status as JSON")
    st.set_defaults(fn=_cmd_status)
    p = sub.add_parser("prepare-data", help="Write the Python-stdlib byte corpus as Parquet.",
                       description="Write the Python-stdlib byte corpus as Parquet token rows.")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence (rows hold seq_len + 1)")
    p.add_argument("--max-mb", type=float, default=8.0, help="corpus size cap in MiB")
    p.set_defaults(fn=_cmd_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ElasticTrainerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
