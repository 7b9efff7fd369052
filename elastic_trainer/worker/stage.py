"""One rank's share of training: its pipeline stage(s) of one replica, its optimizer, its data.

Torch only (no Ray), so it runs under any launcher and in tests with plain
processes. Parameter names are global (``blocks.<index>.<name>``) so a state
taken under one layout loads under another.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from ..checkpoint.flat import ShardExporter
from ..comm.algorithms import ring_allreduce_bytes
from ..comm.stats import CommStats
from ..comm.timing import start_timer
from ..comm.grad_sync import GradSync
from ..comm.shard_exchange import ShardExchange
from ..comm.local_sgd import ModelAverager
from ..comm.parameter_server import PSClient
from ..config import TrainerConfig
from ..config.runtime import MEETING_SYNCS
from ..data.dataset import ensure_prepared
from ..integrity.anomaly import StepAnomaly
from ..lr_schedule import lr_at, set_lr
from ..optim.build import build_optimizer  # noqa: F401 - also this module's, for older callers
from ..parallel.partition import stage_indices_for_rank
from ..parallel.topology import Topology
from .block_build import build_rank_blocks
from .block_forward import AUTOCAST_DTYPES, autocast_call, wrap_block
from .compute_clock import ComputeClock
from .inputs import StageInputs
from .loss_scale import LossScaler
from .process_group import Groups
from .sharded_optimizer import ShardedOptimizer
from .state_checks import StateChecks
from .step_check import StepCheck
from .snapshot_taker import SnapshotTaker
from .stage_state import StageState
from .step_result import StepResult
from .ties import TiedGrads

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class StageTrainer(StageState):
    def __init__(
        self,
        cfg: TrainerConfig,
        topo: Topology,
        rank: int,
        groups: Groups,
        stage_bounds: list[tuple[int, int]],
        device: torch.device,
        ps: tuple | None = None,
        restoring: bool = False,
        held: dict[int, nn.Module] | None = None,
        exporter: ShardExporter | None = None,
    ):
        """``restoring``: the state will be loaded from a snapshot, so blocks are not initialised
        (see ``block_build``); ``held``: the blocks this worker's previous plan gave it, to reuse;
        ``exporter``: the worker's snapshot copy buffers, kept across its plans."""
        self.cfg, self.topo, self.rank, self.groups, self.device = cfg, topo, rank, groups, device
        self.replica, self.pp_rank = topo.coords(rank)
        p = cfg.parallel
        virtual = p.stages_per_rank
        self.num_stages = topo.pp * virtual
        if len(stage_bounds) != self.num_stages:
            raise ValueError(f"{len(stage_bounds)} stage bounds given for {self.num_stages} pipeline stages")
        self.stage_ids = stage_indices_for_rank(self.pp_rank, topo.pp, virtual)
        self.stage_bounds = {s: stage_bounds[s] for s in self.stage_ids}

        own = [i for a, b in self.stage_bounds.values() for i in range(a, b)]
        blocks, loss_fn, self.build_info = build_rank_blocks(cfg.model, cfg.train.seed, own, device, restoring, held)
        train = cfg.train
        for i in self.build_info["built"]:  # held blocks are wrapped already
            wrap_block(blocks[i], train.precision, train.activation_checkpointing)
        loss_fn = autocast_call(loss_fn, AUTOCAST_DTYPES[train.precision])
        self.scaler = (LossScaler(train.loss_scale_init, train.loss_scale_growth_interval)
                       if train.precision == "fp16" else None)
        # The schedules call the loss and run its backward: the scale goes into the loss itself.
        # A pipeline also divides by the micro-batches there (not after, as in fp32), so fp16's
        # gradients stay as small as a single process's and overflow where its would.
        self._loss_mult = 1.0
        self._base_loss = loss_fn
        self._nan_micro: int | None = None   # an injected fault: this micro-batch's loss turns NaN
        self._micro = 0
        self.faults = None                   # integrity faults (worker.integrity_faults), where allowed
        self.modules = {
            s: nn.Sequential(*(blocks[i] for i in range(a, b))) for s, (a, b) in self.stage_bounds.items()
        }
        del blocks
        self.params = [p for m in self.modules.values() for p in m.parameters()]
        self.snapshots = SnapshotTaker(device, cfg.comm.timeout_s, exporter, fingerprint=cfg.checkpoint.verify_restores)
        named = list(self.named_parameters())
        comm = cfg.comm
        self.ties = TiedGrads(self.build_info["ties"], dict(named), stage_bounds, topo, self.replica, groups.pp)
        # Sharded over the DP group (ZeRO-1/2); a lone replica has nothing to shard with.
        sharded = p.shard_optimizer in ("optimizer", "gradients") and topo.dp > 1 and comm.sync == "allreduce"
        exchange = ShardExchange(groups.dp, topo.dp) if sharded else None
        tied = {n for pair in self.build_info["ties"] for n in pair}
        # The pipeline schedules are built not to scale gradients (scale_grads=False):
        # GradSync scales once, after averaging, whatever backward produced (with fp16 the loss
        # already did, see loss_fn above).
        self.sync = GradSync(named, groups.dp, topo.dp if comm.sync == "allreduce" else 1, comm,
                             accumulations=cfg.micro_batches,
                             grad_scale=1.0 if topo.pp == 1 or self.scaler is not None else 1.0 / cfg.micro_batches,
                             seed=cfg.train.seed, exchange=exchange, free_grads=p.shard_optimizer == "gradients",
                             hold={n for n, _ in named if n in tied})
        self.check = StepCheck(cfg, topo, rank, groups, device, sharded)
        self.state_checks = StateChecks(self)
        self.zero = (ShardedOptimizer(named, self.sync, exchange, dist.get_rank(groups.dp), cfg.train,
                                      build_optimizer, skip_in_norm=self.ties.followers) if sharded else None)
        self.optimizer = self.zero.optimizer if self.zero is not None else build_optimizer(named, cfg.train)
        self.model_avg = (ModelAverager(named, groups.dp, topo.dp, comm)
                          if comm.sync in MEETING_SYNCS else None)
        # Parameter-server mode: the shards own the optimizer; this rank's never steps.
        if comm.sync == "parameter_server" and ps is None:
            raise ValueError("comm.sync is parameter_server but no parameter-server shards were given")
        self.ps = (PSClient(named, ps[0], ps[1], self.replica, topo.dp, timeout_s=comm.timeout_s)
                   if comm.sync == "parameter_server" else None)
        self.dense_bytes = sum(ring_allreduce_bytes(b.numel * 4, topo.dp) for b in self.sync.buckets) if topo.dp > 1 else 0

        # What the clip norm sums: a tied pair is one tensor, so its second copy is left out.
        self._norm_params = [p for n, p in named if n not in self.ties.followers]
        self.has_first = 0 in self.stage_ids
        self.has_last = self.num_stages - 1 in self.stage_ids
        if self.has_first or self.has_last:
            ensure_prepared(cfg.data)
        self.inputs = StageInputs(cfg, topo, self.replica, self.has_first, self.has_last, groups.pp, device)
        self.clock = ComputeClock(device)
        # A schedule per micro-batch count: a share other than the equal one (balancing) runs its
        # own, with stages of its own (a stage is prepared for one count), beside the equal one
        # that evaluation keeps using.
        self._schedules: dict[int, object] = {}
        self.schedule = self._schedule_for(cfg.micro_batches) if topo.pp > 1 else None

    def loss_fn(self, out, tgt):
        """A micro-batch's loss as backward takes it: times fp16's scale (and the pipeline's
        1 / micro-batches with it), NaN where a fault was injected into it."""
        loss = self._base_loss(out, tgt)
        if self.scaler is not None:
            loss = loss * self._loss_mult
        if self._nan_micro is not None:
            if self._micro == self._nan_micro:
                loss = loss * float("nan")
            self._micro += 1
        return loss

    def _schedule_for(self, n_micro: int):
        if n_micro not in self._schedules:
            for n in [n for n in self._schedules if n != self.cfg.micro_batches]:
                del self._schedules[n]  # one unequal share at a time is all a replica runs
            self._schedules[n_micro] = self._build_schedule(n_micro)
        return self._schedules[n_micro]

    def _build_schedule(self, n_micro: int):
        stages = [
            PipelineStage(self.modules[s], s, self.num_stages, self.device, group=self.groups.pp)
            for s in self.stage_ids
        ]
        for stage in stages:
            self.clock.instrument_stage(stage)
        loss_fn = self.clock.timed("forward", self.loss_fn)
        if self.cfg.parallel.schedule == "interleaved":
            return ScheduleInterleaved1F1B(stages, n_micro, loss_fn=loss_fn, scale_grads=False)
        return _SCHEDULES[self.cfg.parallel.schedule](stages[0], n_micro, loss_fn=loss_fn, scale_grads=False)

    # -- naming -------------------------------------------------------------
    def named_parameters(self):
        """(global name, parameter) pairs: ``blocks.<global block index>.<name in block>``."""
        for s, (a, _) in self.stage_bounds.items():
            for name, p in self.modules[s].named_parameters():
                idx, _, rest = name.partition(".")
                yield f"blocks.{a + int(idx)}.{rest}", p

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().cpu().clone() for name, p in self.named_parameters()}

    def release_blocks(self) -> dict[int, nn.Module]:
        """This rank's blocks by global index, for the next plan to reuse (after ``close``); their
        gradients are dropped."""
        for p in self.params:
            p.grad = None
        return {a + j: m for s, (a, _) in self.stage_bounds.items() for j, m in enumerate(self.modules[s])}

    @property
    def blocks(self) -> list[int]:
        return [i for a, b in self.stage_bounds.values() for i in range(a, b)]

    def close(self) -> None:
        """Stop the comm and copy threads and drop the gradient hooks (they reference the groups)."""
        self.sync.close()
        self.snapshots.close()
        self.inputs.close()

    # -- one step -------------------------------------------------------------
    def train_step(self, step: int, shares: list[int] | None = None) -> StepResult:
        """Forward and backward over the micro-batches, average grads over DP, judge, clip, apply.

        ``step`` counts from 1; step s reads the global batch at ``inputs.cursor(s)`` (samples
        [(s-1)*B, s*B) where nothing was skipped).
        ``shares``: micro-batches per replica (balancing; None: equal shares). A
        replica's gradient is then weighted by its samples, so the update is the
        equal shares' one: every micro-batch's loss is divided by the equal
        count, whatever this replica runs, and the DP average divides by dp.

        A step judged anomalous (``integrity``) is applied nowhere. With ``on_anomaly: skip`` its
        batch is left out and the step runs again on the next one (the result lists what was
        skipped); otherwise, or past ``max_anomalies``, ``StepAnomaly`` is raised, alike on every rank.
        """
        skipped: list[dict] = []
        while True:
            r = self._attempt(step, shares)
            if r.anomaly is None:
                r.anomalies = skipped
                return r
            a = r.anomaly
            # Corruption is the hardware's, not the data's: its rank's node is quarantined.
            a["action"] = ("quarantine" if a["anomaly"] == "corruption"
                           else self.check.judge.action(step, len(skipped)))
            if a["action"] != "skip":
                raise StepAnomaly(step, a, r.cursor)
            a["samples"] = self.inputs.skip(step)
            skipped.append(a)

    def _attempt(self, step: int, shares: list[int] | None) -> StepResult:
        """One attempt at ``step`` (see ``train_step``)."""
        if shares is not None and (len(shares) != self.topo.dp or sum(shares) != self.topo.dp * self.cfg.micro_batches):
            raise ValueError(f"shares {shares} must give {self.topo.dp} replicas "
                             f"{self.topo.dp * self.cfg.micro_batches} micro-batches in all")
        n_micro = shares[self.replica] if shares is not None else self.cfg.micro_batches
        x, y = self.inputs.train_batch(step, shares)
        schedule = self._schedule_for(n_micro) if self.schedule is not None else None
        self.sync.accumulations = n_micro
        stats = CommStats()
        scale = self.scaler.scale if self.scaler is not None else None
        if scale is not None:
            self._loss_mult = scale / self.cfg.micro_batches if self.topo.pp > 1 else scale
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        if self.zero is not None:
            for p in self.params:
                p.grad = None
        losses: list[torch.Tensor] = []
        if self.faults is not None:
            if self.has_last:
                self._nan_micro, self._micro = self.faults.nan_micro(step, self.rank), 0
            self.state_checks.flip(step, "optimizer")   # held since the last update, as memory corrupts it
        self.sync.begin_step(step)
        clock = self.clock
        clock.begin_step()
        try:
            if schedule is None:
                equal = self.cfg.micro_batches
                forward = clock.timed("forward", lambda xm, ym: self.loss_fn(self.modules[0](xm), ym))
                backward = clock.timed("backward", lambda loss: (loss / equal).backward())
                for xm, ym in zip(x.chunk(n_micro), y.chunk(n_micro)):
                    loss = forward(xm, ym)
                    backward(loss)
                    losses.append(loss.detach())
            else:
                schedule.step(
                    *([x] if self.has_first else []),
                    target=y if self.has_last else None,
                    losses=losses if self.has_last else None,
                    return_outputs=False,
                )
            exposed = 0.0
            if self.zero is not None:
                # Tied gradients are summed before they are averaged: each copy's shard owner differs.
                waited_comm = self.sync.finish(stats, before_held=(lambda: self.ties.sync(stats)) if self.ties else None)
                shard_grads = self.zero.attach_grads()
            else:
                waited_comm = self.sync.finish(stats)  # a timer: read at the end of the step
                if self.ties:
                    exposed += self.ties.sync(stats)
        except BaseException:
            self.sync.abort()
            raise
        finally:
            self._nan_micro = None
        self.state_checks.flip(step, "gradient")
        grads = shard_grads if self.zero is not None else [p.grad for p in self.params if p.grad is not None]
        changed = self.state_checks.changed_at_rest()
        # Every rank's verdict, summed over its DP group then its pipeline (the groups the step's
        # other collectives use): the step's loss, its gradient norm, where a value was not finite.
        verdict, dt = self.check.agree(
            losses if self.has_last else [], self._loss_mult if scale is not None else 1.0,
            self.zero.norm_grads() if self.zero is not None else [p.grad for p in self._norm_params
                                                                 if p.grad is not None],
            self.replica, scale, stats, changed=bool(changed))
        exposed += dt if self.topo.world_size > 1 else 0.0
        decision, anomaly = self.check.judge.judge(step, verdict)
        if anomaly is not None:   # applied nowhere: the scale, the state, the snapshot all stay
            return StepResult(step, verdict.loss, time.perf_counter() - t0 - exposed, stats.seconds, stats.bytes,
                              self.inputs.cursor(step), exposed_comm_s=exposed, loss_scale=scale,
                              lr=lr_at(self.cfg.train, step), micro_batches=n_micro, anomaly=anomaly)
        skipped = decision == "overflow"
        if not skipped:
            self.check.judge.accept(verdict)
        if self.scaler is not None:
            if not skipped:
                self.scaler.unscale_(grads)  # by this step's scale, before update() may change it
            self.scaler.update(skipped)
        # The update below writes the state the previous step's snapshot may still be reading.
        waited = self.snapshots.wait()
        lr = lr_at(self.cfg.train, step)
        set_lr(self.optimizer, lr)
        # On an overflow every rank found it alike (the verdict is the world's): none clips or steps.
        if not skipped:
            if self.cfg.train.grad_clip is not None:
                self.check.clip(grads, verdict, self.cfg.train.grad_clip)
            if self.ps is not None:
                t_ps = time.perf_counter()
                self.ps.push_pull(step, stats)
                exposed += time.perf_counter() - t_ps
            else:
                timer = start_timer(self.device)
                self.optimizer.step()
                clock.add("optimizer", timer.stop())
                if self.zero is not None:
                    timer = start_timer(self.device)
                    self.zero.gather(stats)
                    exposed += timer.stop().seconds()
        if self.model_avg is not None:
            exposed += self.model_avg.maybe_sync(step, stats)
        self.state_checks.flip(step, "parameter")   # as a faulty update writes it
        exposed += waited_comm.seconds()
        wall = time.perf_counter() - t0
        compute_s = wall - exposed - waited
        own, shape = clock.totals(), clock.pass_shape()
        loss = float(torch.stack([l.detach() for l in losses]).mean()) if self.has_last and losses else None
        if loss is not None and scale is not None:
            loss /= self._loss_mult
        return StepResult(step, loss, compute_s, stats.seconds, stats.bytes, self.inputs.cursor(step),
                          exposed_comm_s=exposed, dense_bytes=self.dense_bytes, loss_scale=scale, skipped=skipped,
                          snapshot_wait_s=waited, lr=lr, forward_s=own["forward"], backward_s=own["backward"],
                          optimizer_s=own["optimizer"], wait_s=max(0.0, wall - waited - sum(own.values())),
                          micro_batches=n_micro, passes_steady_s=shape["steady_s"], passes_shape=shape,
                          grad_norm=verdict.grad_norm if not skipped else None, verdict_s=dt)

    def evaluate(self, step: int) -> float | None:
        """Mean loss of ``eval.batches`` held-out batches, forward only, in eval mode (no dropout),
        on this plan: the last stage's ranks return it (None elsewhere). Every layout reads the same
        windows and averages equal shares, so the figure does not depend on dp x pp."""
        losses: list[torch.Tensor] = []
        mult, self._loss_mult = self._loss_mult, 1.0  # fp16's loss scale is for backward only
        for m in self.modules.values():
            m.eval()
        try:
            with torch.no_grad():
                for b in range(self.cfg.eval.batches):
                    x, y = self.inputs.eval_batch(step, b)
                    if self.schedule is None:
                        n_micro = self.cfg.micro_batches
                        losses += [self.loss_fn(self.modules[0](xm), ym).detach()
                                   for xm, ym in zip(x.chunk(n_micro), y.chunk(n_micro))]
                    else:
                        # The schedule clears the list it is given: one per batch.
                        batch: list[torch.Tensor] = []
                        self.schedule.eval(*([x] if self.has_first else []), target=y if self.has_last else None,
                                           losses=batch if self.has_last else None)
                        losses += batch
        finally:
            self._loss_mult = mult
            for m in self.modules.values():
                m.train()
        return float(torch.stack([l.detach().float() for l in losses]).mean()) if self.has_last and losses else None
