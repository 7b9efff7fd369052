"""A fault campaign: many seeded schedules against real runs on one simulated cluster, each held
to the checker's invariants, a failing one shrunk to the fewest faults that still fail and
printed as one command that replays it.

The cluster is this machine's (``ray.cluster_utils.Cluster`` on loopback: a head with no CPUs,
one-CPU nodes, a spare beyond the plan's ranks), the storage an S3 server on loopback (moto)
where it is installed, else a local folder (then no storage outage is struck). Each schedule's
run has its own name and storage prefix; the failure-free run of each config is run once and
is the reference every run of that config is held to.
"""

from __future__ import annotations

import contextlib
import os
import json
import tempfile
from dataclasses import dataclass, field

import ray

from ...checkpoint.durable import CheckpointError, DurableStore
from ...checkpoint.history_log import manifest_history
from ...config import TrainerConfig
from ...data.skips import add_range
from ...storage.uris import split_last
from ...worker.allocator import nodes_start_on
from .checker import (Violation, check_checkpoint, check_counts, check_drains, check_end, check_goodput,
                      check_history, check_leftovers, check_state, check_timeline, layout_of, steps_off_layout)
from .runner import Outcome, run_schedule
from .schedule import LETHAL, Schedule, covering, draw, variant
from .shrink import shrink
from .strike import Striker, wait_until

# Ray declares a removed node dead after this many missed checks this far apart (its defaults
# take about 15 s): the next schedule's top-up waits for it.
_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 4}


@dataclass
class Setting:
    """The runs a campaign drives: the model, the layout, the steps, the spare nodes."""

    steps: int = 24
    dp: int = 2
    pp: int = 2
    spares: int = 1
    durable_every: int = 6
    seq_len: int = 16

    @property
    def world(self) -> int:
        return self.dp * self.pp


@dataclass
class Report:
    schedule: Schedule
    outcome: Outcome
    violations: list[Violation]
    shrunk: Schedule | None = None

    def as_dict(self) -> dict:
        """The schedule, how its run went and what the checker said, as plain values."""
        out = self.outcome
        return {"schedule": json.loads(self.schedule.to_json()), "state": out.state, "seconds": out.seconds,
                "struck": out.struck, "unstruck": out.unstruck, "recoveries_s": self.recoveries(),
                "violations": [str(v) for v in self.violations],
                "shrunk": json.loads(self.shrunk.to_json()) if self.shrunk else None}

    def recoveries(self) -> list[float]:
        return [e["total_s"] for e in self.outcome.events if e.get("kind") == "recovery" and e.get("total_s")
                and e.get("reason") != "grow"]


@dataclass
class Campaign:
    """Runs schedules on a cluster of its own; use as a context manager."""

    setting: Setting = field(default_factory=Setting)
    workdir: str | None = None
    use_s3: bool = True
    deadline_s: float = 300.0
    cluster: object = None        # a cluster someone else started (a test's); else one of its own
    nodes: list = field(default_factory=list)
    # Detection as fast as the tests' (a frozen worker is silent after 1 s).
    timeouts: dict = field(default_factory=lambda: {"startup_timeout_s": 30, "min_step_timeout_s": 3,
                                                    "rendezvous_timeout_s": 10, "wait_for_nodes_s": 2})
    _refs: dict = field(default_factory=dict)
    _runs: int = 0

    def __enter__(self) -> "Campaign":
        from ray.cluster_utils import Cluster

        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # loopback only
        self.prepare()
        self.owns_ray = self.cluster is None
        if self.owns_ray:
            if ray.is_initialized():
                raise RuntimeError("a campaign starts a simulated cluster of its own: this process is connected "
                                   "to a Ray cluster already (give Campaign(cluster=..., nodes=...) to use it)")
            with nodes_start_on("jemalloc"):
                self.cluster = Cluster(initialize_head=True, head_node_args={
                    "num_cpus": 0, "include_dashboard": False, "_system_config": _HEALTH_CHECKS})
            ray.init(address=self.cluster.address)
        self.top_up()
        return self

    def prepare(self, s3_host: str = "127.0.0.1") -> None:
        """The campaign's folder, corpus and S3 server (on ``s3_host``, where moto is installed)."""
        from ...data.corpus import prepare_stdlib_corpus

        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        self._tmp = tempfile.TemporaryDirectory(prefix="et-campaign-") if self.workdir is None else None
        self.root = self.workdir or self._tmp.name
        self.corpus = os.path.join(self.root, "corpus")
        if not os.path.exists(self.corpus):
            prepare_stdlib_corpus(self.corpus, self.setting.seq_len, max_bytes=256 << 10)
        self.s3 = None
        if self.use_s3:
            try:
                from ..s3_server import S3Server
                self.s3 = S3Server(host=s3_host)
                self.bucket = self.s3.bucket("campaign")
            except ImportError:
                self.s3 = None

    def __exit__(self, *exc) -> None:
        if self.s3 is not None:
            self.s3.stop()
        if self.owns_ray and self.cluster is not None:
            ray.shutdown()
            self.cluster.shutdown()
        self.cleanup()

    def cleanup(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # -- the cluster ---------------------------------------------------------------------------
    def top_up(self) -> None:
        """The plan's nodes and the spares, alive and idle, as a schedule starts."""
        want = self.setting.world + self.setting.spares
        c = self.cluster
        self.nodes = [n for n in self.nodes if n in c.worker_nodes] + [n for n in c.worker_nodes
                                                                       if n not in self.nodes]
        for node in self.nodes[want:]:
            c.remove_node(node, allow_graceful=True)
        self.nodes = self.nodes[:want]
        while len(self.nodes) < want:
            with nodes_start_on("jemalloc"):
                self.nodes.append(c.add_node(num_cpus=1))
        ids = {c.head_node.node_id} | {n.node_id for n in self.nodes}
        wait_until(lambda: {n["NodeID"] for n in ray.nodes() if n["Alive"]} == ids
                   and ray.available_resources().get("CPU", 0) == want, 60.0, every_s=0.1)

    def striker(self) -> Striker:
        """What strikes a schedule's faults at the cluster."""
        return Striker(self.cluster, self.nodes, self.s3)

    # -- runs -------------------------------------------------------------------------------------
    def config(self, name: str, kind: str) -> TrainerConfig:
        s = self.setting
        storage = (self.s3.uri(self.bucket, name, secret="query") if self.s3 is not None
                   else os.path.join(self.root, "storage", name))
        return TrainerConfig.from_dict({
            "run": {"name": name, "log_every": 1000, "report_dir": None, "output_dir": os.path.join(self.root, "out", name)},
            "model": {"kind": "gpt", "n_layer": 6, "n_head": 2, "d_model": 32},
            "data": {"path": self.corpus, "seq_len": s.seq_len},
            "train": {"steps": s.steps, "global_batch_size": 8, "micro_batch_size": 1, "lr": 1e-3, "seed": 1,
                      "grad_clip": 1.0},
            "parallel": {"dp": s.dp, "pp": s.pp, "shard_optimizer": "gradients" if kind == "sharded" else "none"},
            "scaling": {"placement_timeout_s": 60, "grow_check_s": 1.0},
            "comm": {"timeout_s": 20},
            "checkpoint": {"memory_every": 1, "storage": storage, "durable_every": s.durable_every,
                           "keep_durable": 2, "verify_restores": True},
            # Every fault of a schedule within the failure budget; straggler balancing off (it would change the
            # micro-batch shares, and with them the sums, of the failure-free run).
            "failure": {"allow_fault_injection": True, "max_failures": 10, "fence_timeout_s": 60,
                        **self.timeouts},
            "balance": {"mode": "detect"},
        })

    def reference(self, kind: str) -> tuple[Outcome, TrainerConfig]:
        """The failure-free run of config ``kind``, once."""
        if kind not in self._refs:
            cfg = self.config(f"camp-ref-{kind}", kind)
            self.top_up()
            out = run_schedule(cfg, Schedule([], None), self.striker(), self.deadline_s)
            if out.state != "FINISHED":
                raise RuntimeError(f"the failure-free {kind} run did not finish: {out.state} {out.error}")
            self._refs[kind] = (out, cfg)
        return self._refs[kind]

    def run(self, schedule: Schedule) -> Report:
        """Run ``schedule`` and check what it left."""
        kind = variant(schedule.seed)
        ref, _ = self.reference(kind)
        self._runs += 1
        name = f"camp-{schedule.seed if schedule.seed is not None else 'x'}-{self._runs}"
        cfg = self.config(name, kind)
        self.top_up()
        out = run_schedule(cfg, schedule, self.striker(), self.deadline_s)
        return Report(schedule, out, self.check(out, ref, cfg))

    def check(self, out: Outcome, ref: Outcome, cfg: TrainerConfig) -> list[Violation]:
        s, lethal = self.setting, sum(1 for x in out.struck if x["kind"] in LETHAL and x.get("done") != "skipped")
        v = check_end(out.state, out.error, lethal, cfg.failure.max_failures)
        v += check_leftovers(out.leftovers)
        v += check_counts(out.struck, out.events)
        v += check_drains(out.struck, out.events)
        v += check_timeline(out.events)
        v += check_goodput(out.goodput, out.events, out.state in ("FINISHED", "STOPPED"))
        if out.state not in ("FINISHED", "STOPPED"):
            return v
        skips = [tuple(r) for r in cfg.data.skip_samples]
        for e in out.events:
            if e["kind"] == "anomaly" and e.get("samples"):
                skips = add_range(skips, *e["samples"])
        v += check_history(out.history, s.steps, cfg.train.global_batch_size, skips)
        reference_layout = layout_of(ref.plans[-1]) if ref.plans else None
        off = steps_off_layout(out.history, out.plans, reference_layout)
        v += check_state(out.model_state, ref.model_state, off, cfg.train.lr)
        v += self._checkpoints(out, cfg)
        return v

    def _checkpoints(self, out: Outcome, cfg: TrainerConfig) -> list[Violation]:
        """Every checkpoint of the run left in storage verifies, covers, loads whole; the final one
        holds the final weights and the whole history."""
        from ...models.factory import block_param_counts

        if not out.durable_path:
            return [Violation("final_checkpoint", "the run reported no final durable checkpoint")]
        store = DurableStore(cfg.checkpoint.storage, out.run_id)
        n_blocks = len(block_param_counts(cfg.model))
        final = split_last(out.durable_path)[1]
        v: list[Violation] = []
        names = [name for _, name in store.entries()]
        if final not in names:
            return [Violation("final_checkpoint", f"{out.durable_path} is not in storage")]
        for name in names:
            try:
                parts, manifest = store.load_dir(name)
            except CheckpointError as e:
                if "was not finished" in str(e) and name != final:
                    continue   # a write a fault cut short: never reported, never resumed
                v.append(Violation("checkpoint_verifies", f"{name}: {e}"))
                continue
            v += check_checkpoint(name, manifest, parts, n_blocks, out.model_state if name == final else None)
            steps = [h["step"] for h in manifest_history(store, manifest)]
            if steps != list(range(1, manifest["step"] + 1)):
                v.append(Violation("checkpoint_history", f"{name}: history steps {steps[:3]}..{steps[-3:]} for "
                                                         f"step {manifest['step']}"))
        return v

    def shrink(self, report: Report) -> Schedule:
        """The fewest of ``report``'s faults that still fail (its config kept: the same seed)."""
        return shrink(report.schedule, lambda s: bool(self.run(s).violations))


def replay_command(schedule: Schedule, setting: Setting) -> str:
    """One command that runs ``schedule`` again."""
    return (f"elastic-trainer campaign --steps {setting.steps} --dp {setting.dp} --pp {setting.pp} "
            f"--replay '{schedule.to_json()}'")


def summary(reports: list[Report]) -> str:
    """``schedules N, violations V, shrunk to ...``."""
    bad = [r for r in reports if r.violations]
    line = f"schedules {len(reports)}, violations {sum(len(r.violations) for r in bad)}"
    if bad:
        line += ", shrunk to " + "; ".join(
            f"[{(r.shrunk or r.schedule).describe()}]" for r in bad)
    return line


def draws(n: int, setting: Setting, start: int = 0, lab: bool = False) -> list[Schedule]:
    """``n`` schedules from seed ``start``: first those that cover every fault kind and point,
    then the seeds after them."""
    out = covering(setting.steps, setting.world, setting.durable_every, lab, start)[:n]
    seed = (max(s.seed for s in out) + 1) if out else start
    while len(out) < n:
        out.append(draw(seed, setting.steps, setting.world, setting.durable_every, lab))
        seed += 1
    return out


def run_campaign(schedules: list[Schedule], setting: Setting, shrink_failures: bool = True, out=print,
                 campaign: Campaign | None = None) -> list[Report]:
    """Run ``schedules`` (on ``campaign``'s cluster, else a new one), printing a line for each and
    the summary; the reports."""
    reports: list[Report] = []
    with (contextlib.nullcontext(campaign) if campaign is not None else Campaign(setting)) as camp:
        for s in schedules:
            r = camp.run(s)
            reports.append(r)
            rec = r.recoveries()
            out(f"seed {s.seed}: {s.describe()} -> {r.outcome.state} in {r.outcome.seconds:.1f}s"
                + (f", recoveries {', '.join(f'{x:.2f}s' for x in rec)}" if rec else "")
                + (f", not reached: {r.outcome.unstruck}" if r.outcome.unstruck else "")
                + ("" if not r.violations else "\n  " + "\n  ".join(map(str, r.violations))))
            if r.violations and shrink_failures and len(s.faults) > 1:
                r.shrunk = camp.shrink(r)
                out(f"  shrunk to {r.shrunk.describe()}: {replay_command(r.shrunk, setting)}")
            elif r.violations:
                out(f"  replay: {replay_command(s, setting)}")
    out(summary(reports))
    return reports


def coverage(reports: list[Report]) -> dict:
    """Fault kinds and points struck, and the recovery times of every struck fault (median, p90, worst)."""
    struck = [x for r in reports for x in r.outcome.struck if x.get("done") != "skipped"]
    times = sorted(t for r in reports for t in r.recoveries())

    def q(p: float) -> float | None:
        return times[min(len(times) - 1, int(p * len(times)))] if times else None

    return {"kinds": sorted({x["kind"] for x in struck}), "points": sorted({x["point"] for x in struck}),
            "recovery_s": {"n": len(times), "median": q(0.5), "p90": q(0.9), "worst": times[-1] if times else None}}


def coverage_line(cov: dict) -> str:
    """The kinds and points struck, and the recovery times, as one line."""
    r = cov["recovery_s"]
    return (f"faults struck: {', '.join(cov['kinds'])}; at: {', '.join(cov['points'])}; recoveries (fault to the "
            "first step after) " + (f"median {r['median']:.2f}s, p90 {r['p90']:.2f}s, worst {r['worst']:.2f}s over "
                                    f"{r['n']}" if r["n"] else "none"))


def report_doc(reports: list[Report], **extra) -> dict:
    """Every schedule's outcome, the coverage, the summary line and the violations counted, as
    plain values (with ``extra`` beside them)."""
    return {"coverage": coverage(reports), "runs": [r.as_dict() for r in reports], "summary": summary(reports),
            "violations": sum(len(r.violations) for r in reports), **extra}


def write_json(path: str, reports: list[Report]) -> None:
    """``report_doc`` of ``reports``, for a later look."""
    with open(path, "w") as f:
        json.dump(report_doc(reports), f, indent=1)
