"""Command line: ``elastic-trainer run | plan | bench-comm | status | stop``, and ``prepare-data | export``
(``data_commands``), ``campaign`` (``campaign_cmd``)."""

from __future__ import annotations

import argparse
import json
import sys

from ..checkpoint.compat import ACCEPTABLE
from ..config import TrainerConfig
from ..errors import ConfigError, ElasticTrainerError
from ..storage.uris import mask
from . import data_commands
from .plan_view import cmd_plan


def _with_straggler(cfg: TrainerConfig, rank: int, factor: float) -> TrainerConfig:
    """``cfg`` whose worker that starts as ``rank`` computes ``factor`` times slower (a demo straggler)."""
    from ..worker.faults import SLOW_FACTOR_ENV, SLOW_RANK_ENV

    world = cfg.parallel.dp * cfg.parallel.pp
    if not 0 <= rank < world:
        raise ConfigError(f"--slow-rank {rank} is not a rank of dp={cfg.parallel.dp} x pp={cfg.parallel.pp} "
                          f"(0..{world - 1})")
    if factor <= 1:
        raise ConfigError(f"--slow-factor {factor:g} must be above 1 (2 = half speed)")
    env = {**cfg.scaling.env_vars, SLOW_RANK_ENV: str(rank), SLOW_FACTOR_ENV: str(factor)}
    return cfg.model_copy(update={
        "scaling": cfg.scaling.model_copy(update={"env_vars": env}),
        "failure": cfg.failure.model_copy(update={"allow_fault_injection": True})})


def balancing_hint(cfg: TrainerConfig) -> str | None:
    """What a user making a straggler should know when balancing cannot move shares on ``cfg``."""
    from ..planning.balancing import share_quantum

    p, t = cfg.parallel, cfg.train
    if cfg.balance.mode != "act" or p.dp < 2 or cfg.comm.sync != "allreduce":
        return None
    m = cfg.micro_batches
    if m > share_quantum(p.pp, p.schedule, m)[0]:
        return None
    return (f"note: {m} micro-batch(es) per replica (train.global_batch_size {t.global_batch_size} / (dp {p.dp} x "
            f"micro_batch_size {t.micro_batch_size})) leave no share to move off the slow replica; "
            f"--set train.micro_batch_size=1 gives {t.global_batch_size // p.dp} per replica (else balancing "
            + ("can only re-cut the stages or leave the rank out" if p.pp > 1 else "can only leave the rank out")
            + ", where that repays)")


def _cmd_run(args) -> int:
    from ..trainer import Trainer

    cfg = TrainerConfig.from_yaml(args.job, args.set)
    if args.slow_rank is not None:
        cfg = _with_straggler(cfg, args.slow_rank, args.slow_factor)
        hint = balancing_hint(cfg)
        if hint:
            print(hint, file=sys.stderr)
    resume, accept = args.resume_from or args.resume, args.accept_change
    if accept and not resume:
        raise ConfigError(f"--accept-change {','.join(accept)} names what a resumed run may change: add --resume "
                          "(the run named run.name) or --resume-from RUN_ID|CHECKPOINT")
    if args.kill_node_at_step is not None and not args.simulate_nodes:
        raise ConfigError("--kill-node-at-step needs --simulate-nodes N (a local multi-node cluster to kill a node of)")
    if args.simulate_nodes:
        import time

        from ..chaos.simulate import simulated_cluster

        if cfg.run.name is None:  # the killer finds the run's controller by name
            cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": time.strftime("et-%Y%m%d-%H%M%S")})})

        with simulated_cluster(args.simulate_nodes, cfg) as sim:
            result = Trainer(cfg, on_step=sim.killer(args.kill_node_at_step)).fit(resume=resume, accept_change=accept)
    else:
        result = Trainer(cfg).fit(resume=resume, accept_change=accept)
    if result.final_loss is None:
        print(f"run {result.run_name}: {result.state.lower()} before its first step")
        return 0
    print(f"run {result.run_name}: final loss {result.final_loss:.4f} after {len(result.history)} steps"
          + (f", {len(result.failures)} failure(s) survived" if result.failures else ""))
    return 0


def _cmd_bench_comm(args) -> int:
    import shlex

    import torch.multiprocessing as mp

    from ..planning import calibration as bench
    from ..planning.cost_model import size_range

    try:
        lo, hi = bench.parse_size(args.min), bench.parse_size(args.max)
        sizes = size_range(lo, hi)
    except ValueError as e:
        raise ElasticTrainerError(f"--min {args.min!r} / --max {args.max!r}: {e}") from None
    if len(sizes) < 2:
        raise ElasticTrainerError(f"--min {args.min} and --max {args.max} give one message size; fitting alpha and "
                                  "beta needs at least two (e.g. --max twice --min)")
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    try:
        rows = bench.run_sweep(args.procs, sizes, algorithms, args.iters)
        fits = bench.fit_constants(rows)
    except ValueError as e:
        raise ElasticTrainerError(str(e)) from None
    except (TimeoutError, mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        raise ElasticTrainerError(f"the {args.procs}-process sweep failed: {e}") from None
    # A quick sweep gets a quick stream; 64 MiB is already far past TCP's ramp-up on loopback.
    loopback = None if args.no_loopback else bench.loopback_throughput(min(bench.LOOPBACK_BYTES, max(hi, 64 << 20)))
    # Every setting that shaped the numbers, so the file says how to measure them again.
    command = (f"elastic-trainer bench-comm --procs {args.procs} --min {shlex.quote(args.min)} "
               f"--max {shlex.quote(args.max)} --algorithms {','.join(algorithms)} --iters {args.iters}")
    doc = bench.constants_document(rows, fits, loopback, procs=args.procs, backend="gloo", command=command)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
    if args.json:
        print(json.dumps({**doc, "rows": rows, "loopback": loopback, "peak_busbw_Bps": bench.peak_busbw(rows)},
                         indent=2))
        return 0
    print(bench.format_table(rows))
    print()
    if loopback is not None:
        lb = loopback["bytes_per_s"]
        print(f"# loopback TCP limit (one stream, {loopback['nbytes'] >> 20} MiB, best of "
              f"{len(loopback['runs_Bps'])}): {lb / 1e9:.3f} GB/s")
        for name, bw in bench.peak_busbw(rows).items():
            print(f"#   peak busbw {name:>8}: {bw / 1e9:.3f} GB/s = {bw / lb:.2f} x loopback")
        print()
    print(f"# alpha-beta fit (relative least squares), {args.procs} ranks")
    print(bench.format_fits(fits, None if loopback is None else loopback["bytes_per_s"]))
    for name, f in fits.items():
        bad = [k for k, v in (("alpha", f["alpha_s"]), ("beta", f["beta_s_per_byte"])) if v < 0]
        if bad and not f.get("derived_from"):
            print(f"warning: {name}'s fit has {' and '.join(b + ' < 0' for b in bad)}: these sizes do not separate "
                  "latency from bandwidth; widen --min..--max, raise --iters or measure on a quieter machine "
                  "(plan refuses negative constants)")
    if args.out:
        print(f"\nwrote the fitted constants to {args.out} (elastic-trainer plan JOB.yaml --constants {args.out})")
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


def _connect(args) -> str:
    """Join the cluster of ``--address`` (else $RAY_ADDRESS, else the local one) as a client."""
    import os

    import ray

    from ..naming import NAMESPACE

    address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
    _check_reachable(address)
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    except ConnectionError as e:
        raise ElasticTrainerError(f"no Ray cluster at --address {address!r}: {e}") from None
    return address


def _cmd_stop(args) -> int:
    import ray

    from .status import live_statuses, stop_run

    address = _connect(args)
    try:
        taken = stop_run(args.run, args.reason)
        live = [st["run"] for st in live_statuses()] if taken is None else []
    finally:
        ray.shutdown()
    if taken is None:
        print(f"no live run {args.run!r} on {address}; live runs: {', '.join(live) or 'none'}", file=sys.stderr)
        return 1
    print(f"run {args.run!r}: " + ("stopping after the steps in flight; its weights and final durable "
                                   "checkpoint are saved as at the end" if taken
                                   else "a stop was already asked, or the run has ended"))
    return 0


def _cmd_status(args) -> int:
    import ray

    from .status import format_status, live_statuses

    address = _connect(args)
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


def build_parser() -> argparse.ArgumentParser:
    from . import campaign_cmd

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
                     help="continue the run named run.name from its newest durable checkpoint in "
                          "checkpoint.storage (start fresh if it has none); the config must match the "
                          "checkpoint's but for the layout (dp, pp, placement, ...)")
    run.add_argument("--resume-from", metavar="RUN_ID|CHECKPOINT",
                     help="continue the run of this id from its newest checkpoint, or this checkpoint "
                          "directory (<storage>/step-<N>-<run id>); an older one of its run starts a branch")
    run.add_argument("--accept-change", action="append", default=[], metavar="FIELD[,FIELD]",
                     help="with --resume(-from): let these fields differ from the checkpoint's config "
                          f"({', '.join(ACCEPTABLE)}); repeatable")
    run.add_argument("--simulate-nodes", type=int, metavar="N",
                     help="start a local cluster of N simulated nodes (one machine) and run on it")
    run.add_argument("--kill-node-at-step", type=int, metavar="K",
                     help="with --simulate-nodes: kill (SIGKILL) the node of the last rank once step K is done")
    run.add_argument("--slow-rank", type=int, metavar="R",
                     help="make the worker that starts as rank R compute --slow-factor times slower (a straggler, "
                          "to watch its pace and the straggler event)")
    run.add_argument("--slow-factor", type=float, default=2.0, metavar="F", help="with --slow-rank (default 2)")
    run.set_defaults(fn=_cmd_run)
    plan = job_command("plan", "Predict step time of every dp x pp, compression and sync on the workers, recommend "
                               "one, and print the plan (topology, stage cut) the job as configured would use.")
    plan.add_argument("--workers", type=int, metavar="N",
                      help="workers to plan for (candidates use at most N; default: dp * pp of the job)")
    plan.add_argument("--constants", metavar="FILE",
                      help="alpha/beta JSON from `elastic-trainer bench-comm --out FILE` (default: the job's "
                           "comm.constants, else the constants built into elastic_trainer.planning.constants)")
    plan.add_argument("--memory-gb", type=float, metavar="GB",
                      help="memory one worker may use (GiB); layouts that need more are left out (default: the "
                           "job's scaling.worker_memory_gb, else no bound)")
    plan.add_argument("--json", action="store_true",
                      help="print JSON: the plan's keys as before, plus 'predictions' (candidates, recommendation, "
                           "and 'replan': the layout a run re-plans to on these workers)")
    plan.set_defaults(fn=cmd_plan)
    bc = sub.add_parser("bench-comm", help="Measure all-reduce algorithms over local processes and fit alpha/beta.",
                        description="Time ring, tree and chunked all-reduce over --procs local gloo processes "
                                    "(loopback TCP), print an nccl-tests style table, the loopback TCP limit, "
                                    "and the fitted alpha-beta constants per algorithm.")
    bc.add_argument("--procs", type=int, default=4, help="local processes (ranks), default 4")
    bc.add_argument("--min", default="1KiB", help="smallest message, e.g. 1KiB (default)")
    bc.add_argument("--max", default="256MiB", help="largest message, e.g. 256MiB (default); sizes double")
    bc.add_argument("--algorithms", default="ring,tree,chunked,allgather,alltoall",
                    help="comma-separated, default ring,tree,chunked,allgather,alltoall (the last two: the "
                         "exchanges the int8 and top-k codecs send, priced apart)")
    bc.add_argument("--iters", type=int, default=10, help="timed iterations per size (median), default 10")
    bc.add_argument("--no-loopback", action="store_true", help="skip the loopback TCP stream measurement")
    bc.add_argument("--json", action="store_true", help="print rows, fits and loopback limit as JSON")
    bc.add_argument("--out", metavar="FILE", help="write the fitted constants as JSON for `plan --constants`")
    bc.set_defaults(fn=_cmd_bench_comm)
    st = sub.add_parser("status", help="Show the live runs on a cluster: plan, step, throughput, failures.",
                        description="Show the live runs on a Ray cluster, read from their controllers.")
    st.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else the local cluster)")
    st.add_argument("--run", help="only this run")
    st.add_argument("--json", action="store_true", help="print the raw status as JSON")
    st.set_defaults(fn=_cmd_status)
    sp = sub.add_parser("stop", help="End a live run at the next step boundary, saved: it ends STOPPED.",
                        description="Ask a live run's controller to stop after the steps in flight. The weights "
                                    "and the final durable checkpoint of its last step are written as at the end "
                                    "(killing the job instead saves nothing); `run --resume` continues it.")
    sp.add_argument("run", help="the run's name (run.name; `elastic-trainer status` lists them)")
    sp.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else the local cluster)")
    sp.add_argument("--reason", default="elastic-trainer stop", help="recorded in the run's stop_requested event")
    sp.set_defaults(fn=_cmd_stop)
    data_commands.add_parsers(sub)
    campaign_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ElasticTrainerError as e:
        print(f"error: {mask(str(e))}", file=sys.stderr)   # a URI typed with its secret is shown without
        return 2
    except KeyboardInterrupt:
        # A run's second Ctrl-C has already said what it kept; anything else was just interrupted.
        return 130


if __name__ == "__main__":
    sys.exit(main())
