"""Command line: ``elastic-trainer run | plan | prepare-data``."""

from __future__ import annotations

import argparse
import json
import sys

from .config import TrainerConfig
from .errors import ElasticTrainerError


def _cmd_run(args) -> int:
    from .trainer import Trainer

    cfg = TrainerConfig.from_yaml(args.job, args.set)
    result = Trainer(cfg).fit(resume=args.resume)
    print(f"run {result.run_name}: final loss {result.final_loss:.4f} after {len(result.history)} steps")
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
    run.set_defaults(fn=_cmd_run)
    job_command("plan", "Print the plan (topology, stage cut) a job would use, without running it.").set_defaults(
        fn=_cmd_plan)
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
