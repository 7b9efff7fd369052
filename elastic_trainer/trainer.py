"""The driver-side API: ``Trainer(cfg).fit() -> Result``."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .checkpoint.compat import resume_request
from .config import TrainerConfig
from .controller.controller import ControllerActor
from .controller.run.goodput import lost_line
from .controller.state.saving import SaveError  # noqa: F401  (a run's error, importable from here)
from .data.dataset import ensure_prepared
from .data.splits import data_order, open_datasets
from .errors import DataError, ElasticTrainerError
from .models.hf import load_hf_config
from .models.build import whole_build_warning
from .models.factory import resolve_factory
from .naming import NAMESPACE, controller_name
from .planning.constants import run_constants
from .planning.model_shape import ModelShape, ShapeInBackground
from .reporting.progress import ProgressPrinter
from .reporting.rank_file import RankFile, ranks_path, read_rank_figures
from .storage.credentials import storage_env
from .storage.uris import is_uri, join
from .storage.preflight import check_storage
from .worker.allocator import nodes_start_on


@dataclass
class Result:
    """What a run produced."""

    run_name: str
    history: list[dict]          # one record per step: step, loss, dp, pp, world_size, step_time_s, tokens_per_s, ...
    events: list[dict]           # state transitions, failures, recoveries, checkpoints, with times
    plan: dict                   # topology, stage cut and node of every rank
    workers: list[dict] = field(default_factory=list)
    plans: list[dict] = field(default_factory=list)  # every plan the run used; history's "plan" indexes it
    model_state: dict[str, Any] | None = None  # global parameter name -> tensor, when asked for
    report_path: str | None = None  # the run report PNG, if written
    model_path: str | None = None   # the final weights (model.safetensors), written and read back
    durable_path: str | None = None  # the final durable checkpoint, where checkpoint.storage is set
    hf_path: str | None = None       # model.kind hf: a folder AutoModelForCausalLM.from_pretrained loads
    run_id: str | None = None        # the id its durable checkpoints carry
    state: str = "FINISHED"          # FINISHED: every step run; STOPPED: ended early by Controller.stop()
    step: int | None = None          # the last step run, which the weights (and durable_path) hold
    ranks_path: str | None = None    # each step's per-rank compute, wait and pace (JSON lines), with report_dir
    # Where the wall time went: {"wall_s", "effective_s", "goodput", "seconds": bucket -> s}
    # (controller.run.goodput.BUCKETS; the buckets add up to wall_s).
    goodput: dict | None = None

    @property
    def finished(self) -> bool:
        """Every step was run (a failed run raises instead of returning)."""
        return self.state == "FINISHED"

    @property
    def stopped(self) -> bool:
        """A stop ended the run before its last step, at ``step``; what it had is saved."""
        return self.state == "STOPPED"

    @property
    def failures(self) -> list[dict]:
        return [e for e in self.events if e["kind"] == "failure"]

    @property
    def recoveries(self) -> list[dict]:
        return [e for e in self.events if e["kind"] == "recovery"]

    @property
    def final_loss(self) -> float | None:
        return self.history[-1]["loss"] if self.history else None


class Trainer:
    """Runs one training job on a Ray cluster.

    Ray connection: an existing ``ray.init`` in this process is used as is;
    else ``RAY_ADDRESS`` names the cluster to join; else a local single-node
    cluster is started (and shut down after ``fit``).
    """

    def __init__(self, config: TrainerConfig, on_step: Callable[[dict], None] | None = None, verbose: bool = True,
                 on_start: Callable[[object], None] | None = None):
        """``on_step``: called with each step's record as the driver sees it. ``on_start``: called
        with the run's controller actor before the run starts (a fault campaign arms its fault
        points with it: ``chaos.campaign``)."""
        self.config = config
        self.on_step = on_step
        self.on_start = on_start
        self.verbose = verbose
        self.report_path: str | None = None  # the run report PNG of the last fit
        self.ranks_path: str | None = None   # the per-rank figures of the last fit (rank_file.py)
        self._data: dict = {}                # the data fingerprint, sent to the controller

    def fit(self, return_model_state: bool = False, resume: bool | str = False,
            accept_change: str | Iterable[str] = ()) -> Result:
        """Train. ``resume`` (after the cluster or the driver was lost): True continues the run
        named run.name from its newest durable checkpoint in ``checkpoint.storage``; a run id
        continues that run; a checkpoint path (``<storage>/step-<N>-<run id>``) that checkpoint.
        ``accept_change``: fields the resumed run may change (``checkpoint.compat.ACCEPTABLE``:
        train.steps, train.lr, the schedule), listed in its resume event; any other difference
        from the checkpoint's config but the layout is refused."""
        cfg = self.config
        resume = resume_request(resume, accept_change, cfg.run.name)
        run_name = cfg.run.name or time.strftime("et-%Y%m%d-%H%M%S")
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": run_name})})
        cfg = self._check_inputs(cfg)
        shape = ShapeInBackground(cfg)
        started_ray = self._connect(cfg)
        try:
            return self._run(cfg, run_name, return_model_state, resume, shape.result())
        finally:
            if started_ray:
                ray.shutdown()

    def _report(self, cfg: TrainerConfig, run_name: str, history: list[dict], events: list[dict],
                goodput: dict | None = None) -> None:
        """Write the run report PNG; a report that cannot be drawn never fails the run."""
        if cfg.run.report_dir is None:
            return
        from .reporting.report import write_report

        path = os.path.join(os.path.expanduser(cfg.run.report_dir), f"{run_name}.png")
        try:
            write_report(history, events, path, title=f"run {run_name}",
                         ranks=read_rank_figures(self.ranks_path) if self.ranks_path else None, goodput=goodput)
        except Exception as e:  # noqa: BLE001 - the training result matters more than its picture
            print(f"run report not written ({type(e).__name__}: {e})", file=sys.stderr)
            return
        self.report_path = path
        if self.verbose:
            print(f"run report: {path}", flush=True)

    def _check_inputs(self, cfg: TrainerConfig) -> TrainerConfig:
        """Fail before any worker starts: bad data and bad factories are cheap to find here."""
        resolve_factory(cfg.model)
        # Wrong credentials or a missing bucket fail here, not at the first write minutes in.
        check_storage([("data.path", cfg.data.path), ("eval.path", cfg.eval.path),
                       ("checkpoint.storage", cfg.checkpoint.storage), ("run.output_dir", output_dir(cfg))],
                      cfg.failure.storage_retries)
        whole = whole_build_warning(cfg.model)
        if whole:
            print(f"warning: {whole}", file=sys.stderr)
        model = cfg.model
        if model.kind == "hf":
            # Workers do not share the driver's working directory: local paths become absolute.
            paths = {k: _absolute(getattr(model, k)) for k in ("hf_config", "init_from")
                     if isinstance(getattr(model, k), str)}
            model = model.model_copy(update=paths)
            # A bad config fails here, not on every worker; its vocabulary bounds the data's ids.
            vocab = getattr(load_hf_config(model.hf_config, model.init_from), "vocab_size", None)
        else:
            vocab = model.vocab_size if model.kind == "gpt" else None  # a factory's is its own
        data = cfg.data.model_copy(update={"path": _absolute(cfg.data.path)})
        ev = cfg.eval.model_copy(update={"path": _absolute(cfg.eval.path)}) if cfg.eval.path else cfg.eval
        ensure_prepared(data)
        checked = cfg.model_copy(update={"data": data, "eval": ev, "model": model})
        train, evald = open_datasets(checked, cfg.failure.storage_retries)
        _check_vocab(vocab, [d for d in (train, evald) if d is not None])
        # The order is recorded too: a resume that would read the samples in another order is refused.
        self._data = {**train.fingerprint(), "order": list(data_order(checked.data, train))}
        run = cfg.run.model_copy(update={"output_dir": output_dir(cfg)})
        comm = cfg.comm
        if comm.constants is not None:
            # Read by the controller (on this node, in another directory) when it re-plans.
            comm = comm.model_copy(update={"constants": os.path.abspath(os.path.expanduser(comm.constants))})
            run_constants(cfg.model_copy(update={"comm": comm}))
        return checked.model_copy(update={"comm": comm, "run": run})

    def _connect(self, cfg: TrainerConfig) -> bool:
        if ray.is_initialized():
            return False
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"])
            return False
        started_here = _started_cluster()
        if started_here:
            # `ray start --head` ran on this machine: join it, as `ray.init()` would (Ray refuses
            # a cluster of our own size while that one runs).
            with _loopback_kept(started_here):
                ray.init(address=started_here)
            return False
        res = cfg.scaling.resources_per_worker
        num_cpus = max(os.cpu_count() or 1, int(res.get("CPU", 1) * cfg.world_size + 0.999))
        # A local cluster is for this machine only: keep it on loopback (Ray would otherwise
        # resolve 127.0.0.1 to the machine's routable address and listen there).
        # Its processes start on the workers' allocator, so Ray's idle ones can serve as workers.
        with _loopback_kept("127.0.0.1"), nodes_start_on(cfg.scaling.cpu_allocator, cfg.scaling.uses_gpu):
            ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1")
        return True

    def _run(self, cfg: TrainerConfig, run_name: str, return_model_state: bool, resume: bool,
             shape: ModelShape | None = None) -> Result:
        node_id = ray.get_runtime_context().get_node_id()
        env = storage_env()   # the storage's credentials: the controller passes them on to the workers
        controller = ray.remote(ControllerActor).options(
            name=controller_name(run_name), namespace=NAMESPACE, num_cpus=0, max_concurrency=8, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            **({"runtime_env": {"env_vars": env}} if env else {}),
        ).remote(cfg.model_dump(mode="json"), run_name, self._data, shape)
        printer = ProgressPrinter(cfg, stream=sys.stdout) if self.verbose else None
        if self.on_start:
            self.on_start(controller)
        done_ref = controller.run.remote(return_model_state, resume)
        # What the driver has seen, kept so a failed run still gets its report.
        history: list[dict] = []
        events: list[dict] = []
        ranks = RankFile(ranks_path(cfg.run.report_dir, run_name)) if cfg.run.report_dir is not None else None
        self.ranks_path = ranks.path if ranks else None
        seen_ranks = 0
        try:
            while True:
                ready, _ = ray.wait([done_ref], timeout=0.2)
                try:
                    prog = ray.get(controller.progress.remote(len(history), len(events),
                                                              seen_ranks if ranks else None))
                except ray.exceptions.RayActorError:
                    ready = [done_ref]
                    prog = {"records": [], "events": [], "length": len(history), "n_events": len(events)}
                if ranks and "ranks" in prog:
                    ranks.write(prog["ranks"], prog["ranks_dropped"])
                    seen_ranks += len(prog["ranks"]) + prog["ranks_dropped"]
                for ev in prog["events"]:
                    if printer:
                        printer.event(ev)
                events.extend(prog["events"])
                # A rollback shortens the history: continue from where it stands now.
                del history[prog["length"] - len(prog["records"]):]
                for rec in prog["records"]:
                    history.append(rec)
                    if printer:
                        printer.step(rec)
                    if self.on_step:
                        self.on_step(rec)
                if ready:
                    break
            try:
                out = ray.get(done_ref)
            except ray.exceptions.RayTaskError as e:
                # Our own errors say all in their message (the controller's log has the trace); an
                # unexpected one keeps the remote traceback. Ray colours it; the report wants text.
                cause = e.cause if isinstance(e.cause, ElasticTrainerError) else e.as_instanceof_cause()
                error = re.sub(r"\x1b\[[0-9;]*m", "", str(cause))
                self._report(cfg, run_name, history, events + [{"kind": "state", "to": "FAILED", "error": error}])
                # What the driver saw of the failed run goes with its error: the steps and events.
                with contextlib.suppress(AttributeError, TypeError):
                    cause.history, cause.events = history, events
                raise cause from None
        finally:
            ray.kill(controller, no_restart=True)
            if ranks:
                ranks.close()
        if printer:
            printer.done(out["history"], out["state"])
            if out.get("goodput"):
                print(lost_line(out["goodput"]), flush=True)
            print(f"weights: {out['model_path']}", flush=True)
            if out.get("hf_path"):
                print(f"hugging face folder: {out['hf_path']}", flush=True)
        self.report_path = None
        self._report(cfg, run_name, out["history"], out["events"], out.get("goodput"))
        return Result(run_name=run_name, history=out["history"], events=out["events"], plan=out["plan"],
                      workers=out["workers"], plans=out["plans"], model_state=out["model_state"],
                      report_path=self.report_path, model_path=out["model_path"],
                      durable_path=out["durable_path"], run_id=out["run_id"], hf_path=out.get("hf_path"),
                      state=out["state"], step=out["step"], ranks_path=self.ranks_path, goodput=out.get("goodput"))


def output_dir(cfg: TrainerConfig) -> str:
    """Where a run's weights go: ``run.output_dir``, else a folder named after the run under
    ``checkpoint.storage`` where that is set, else beside the reports. Local paths absolute
    (the controller runs in another directory)."""
    out = cfg.run.output_dir
    if out is None:
        base = cfg.checkpoint.storage or cfg.run.report_dir or "elastic_trainer_reports"
        out = join(base, cfg.run.name)
    return out if is_uri(out) else os.path.abspath(os.path.expanduser(out))


def _absolute(path: str) -> str:
    """A local path made absolute (workers run elsewhere); filesystem URIs as given."""
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def _check_vocab(vocab: int | None, datasets: list) -> None:
    """Token ids the model has no embedding for fail here, named, not as an IndexError on a worker."""
    for ds in datasets:
        top = ds.max_token_id
        if vocab is not None and top is not None and top >= vocab:
            raise DataError(f"{ds.source!r} holds token ids up to {top}, but the model's vocabulary has {vocab} "
                            f"(ids 0..{vocab - 1}): raise the model's vocab_size to at least {top + 1}, or "
                            "tokenize with a matching tokenizer")


def _started_cluster() -> str | None:
    """The address the last `ray start` on this machine left, if that cluster still runs."""
    try:
        from ray._private.services import find_bootstrap_address
        return find_bootstrap_address(None)
    except Exception:  # a private Ray helper: its absence means "none known"
        return None


@contextlib.contextmanager
def _loopback_kept(address: str):
    """Ray resolves a loopback address to this machine's routable one unless
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: for joining a head started with `--node-ip-address
    127.0.0.1` (where the cluster does not listen otherwise), and for starting a local cluster
    (which would listen there). Kept on loopback, as that variable would."""
    from ray._private import ray_constants

    loopback = address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost", "::1", "[::1]")
    before = ray_constants.ENABLE_RAY_CLUSTER
    if loopback:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before
