"""The driver-side API: ``Trainer(cfg).fit() -> Result``, ``Trainer(cfg).start() -> Run``."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Callable, Iterable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .checkpoint.compat import resume_request
from .config import TrainerConfig
from .controller.controller import ControllerActor
from .controller.run.goodput import lost_line
from .controller.state.saving import SaveError  # noqa: F401  (a run's error, importable from here)
from .data.dataset import ensure_prepared
from .data.splits import data_order, open_datasets
from .errors import DataError
from .models.hf import load_hf_config
from .models.build import whole_build_warning
from .models.dcp_load import DCPWeights
from .models.factory import resolve_factory
from .naming import NAMESPACE, controller_name
from .planning.constants import run_constants
from .planning.model_shape import ModelShape, ShapeInBackground
from .reporting.progress import ProgressPrinter
from .reporting.rank_file import RankFile, ranks_path, read_rank_figures
from .results import Result
from .run_handle import Run, hold_to_the_end, strip_colour
from .storage.credentials import storage_env
from .storage.uris import is_uri, join, mask
from .storage.preflight import check_storage
from .trackers import check_trackers, open_trackers
from .worker.allocator import nodes_start_on


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

    def start(self, return_model_state: bool = False, resume: bool | str = False,
              accept_change: str | Iterable[str] = (), _follow: bool = True) -> Run:
        """Start the run and return its handle (``Run``: ``status()``, ``wait()``, ``stop()``,
        ``result()``) while it trains. The arguments are ``fit``'s."""
        cfg = self.config
        resume = resume_request(resume, accept_change, cfg.run.name)
        run_name = cfg.run.name or time.strftime("et-%Y%m%d-%H%M%S")
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": run_name})})
        cfg = self._check_inputs(cfg)
        shape = ShapeInBackground(cfg)
        started_ray = self._connect(cfg)
        try:
            return self._start(cfg, run_name, return_model_state, resume, shape.result(), started_ray, _follow)
        except BaseException:
            if started_ray:
                ray.shutdown()
            raise

    def fit(self, return_model_state: bool = False, resume: bool | str = False,
            accept_change: str | Iterable[str] = ()) -> Result:
        """Train to the end: ``start().result()``. ``resume`` (after the cluster or the driver
        was lost): True continues the run named run.name from its newest durable checkpoint in
        ``checkpoint.storage``; a run id continues that run; a checkpoint path
        (``<storage>/step-<N>-<run id>``) that checkpoint. ``accept_change``: fields the resumed
        run may change (``checkpoint.compat.ACCEPTABLE``: train.steps, train.lr, the schedule),
        listed in its resume event; any other difference from the checkpoint's config but the
        layout is refused.

        Ctrl-C (SIGINT) or SIGTERM (``ray job stop``) stops the run as ``Run.stop()`` does: the
        step in flight completes and is saved, and the run ends STOPPED. A second one ends it at
        once, says what was kept and raises ``KeyboardInterrupt``."""
        return hold_to_the_end(self.start(return_model_state, resume, accept_change, _follow=False))

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
        check_trackers(cfg)
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
            if model.init_from:
                # A torch distributed checkpoint: absolute for the workers, and a folder that is
                # none fails here rather than on every worker.
                model = model.model_copy(update={"init_from": _absolute(model.init_from)})
                DCPWeights(model.init_from)
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

    def _start(self, cfg: TrainerConfig, run_name: str, return_model_state: bool, resume: bool,
               shape: ModelShape | None, started_ray: bool, follow: bool = True) -> Run:
        node_id = ray.get_runtime_context().get_node_id()
        # What the driver writes while the run goes: made before the controller, so a report
        # folder that cannot be made or a tracker's start leaves no run behind.
        ranks = RankFile(ranks_path(cfg.run.report_dir, run_name)) if cfg.run.report_dir is not None else None
        self.ranks_path = ranks.path if ranks else None
        printer = ProgressPrinter(cfg, stream=sys.stdout) if self.verbose else None
        trackers = open_trackers(cfg, run_name)
        if printer:
            for line in trackers.where:
                print(line, flush=True)
        controller = None
        try:
            # The storage's credentials go as a constructor argument, which Ray shows nowhere (a
            # runtime_env is listed by `ray list actors --detail` and the dashboard); the controller
            # sets them into its environment and hands them to the workers the same way.
            controller = ray.remote(ControllerActor).options(
                name=controller_name(run_name), namespace=NAMESPACE, num_cpus=0, max_concurrency=8, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(cfg.model_dump(mode="json"), run_name, self._data, shape, env=storage_env())
            if self.on_start:
                self.on_start(controller)
            done_ref = controller.run.remote(return_model_state, resume)
        except BaseException:
            if controller is not None:
                ray.kill(controller, no_restart=True)
            trackers.close("FAILED", None)
            if ranks:
                ranks.close()
            raise

        def finish(out: dict | None, history: list[dict], events: list[dict], error: BaseException | None) -> Result:
            return self._finish(cfg, run_name, out, history, events, error, printer)

        return Run(run_name, controller, done_ref, printer=printer, on_step=self.on_step, ranks=ranks,
                   trackers=trackers, finish=finish, shutdown_ray=started_ray, follow=follow)

    def _finish(self, cfg: TrainerConfig, run_name: str, out: dict | None, history: list[dict],
                events: list[dict], error: BaseException | None, printer: ProgressPrinter | None) -> Result:
        """The run's ``Result`` from the controller's output (None: it was ended at once), or its
        error raised with what the driver saw of it (its steps and events) and its report."""
        self.report_path = None
        if error is not None:
            text = mask(strip_colour(str(error)))
            self._report(cfg, run_name, history, events + [{"kind": "state", "to": "FAILED", "error": text}])
            with contextlib.suppress(AttributeError, TypeError):
                error.history, error.events = history, events
            raise error
        if out is None:
            durable = [e for e in events if e["kind"] == "durable_checkpoint"]
            step = history[-1]["step"] if history else None
            self._report(cfg, run_name, history, events + [{"kind": "state", "to": "ABORTED"}])
            return Result(run_name=run_name, history=history, events=events, plan={}, state="ABORTED", step=step,
                          durable_path=durable[-1]["path"] if durable else None,
                          report_path=self.report_path, ranks_path=self.ranks_path)
        if printer:
            printer.done(out["history"], out["state"])
            if out.get("goodput"):
                print(lost_line(out["goodput"]), flush=True)
            print(f"weights: {out['model_path']}", flush=True)
            if out.get("hf_path"):
                print(f"hugging face folder: {out['hf_path']}", flush=True)
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
