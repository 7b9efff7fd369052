"""Bytes one worker holds under a layout, buffer by buffer, device and host apart.

Per parameter of the rank's own blocks (:class:`MemoryModel`, from the run's
config): the fp32 weight and its gradient, the optimizer's state (AdamW's two
moments; SGD with momentum one, Adafactor about none: ``optim.choice.state_floats``), the fp32
gradient buckets a data-parallel all-reduce flattens the gradients into
(every bucket is alive at the end of the backward), the error-feedback
residual of int8/topk/powersgd or DiLoCo's outer copy and momentum; then
activations (below). Those live on the worker's device. In host memory: the
rank's local snapshot copies (``checkpoint.snapshots_kept`` of them, weights
and moments each; none on a CPU rank without replicas, which lends its live
tensors to the object store instead), the parts it puts into its node's object
store (``snapshots_kept`` of its 1/dp share, and the next while it is put:
written through the worker's own mapping of the store, its resident set holds
them; measured, see docs/models.md) and the process itself (interpreter, torch, Ray: measured
here at about 400 MiB, a worker after its set-up before it builds). On a CPU worker device and host are one memory, and a
worker's bound holds the sum; on a GPU the bound holds the device's part.
Apart from the worker: the other ``checkpoint.replicas - 1`` copies of each
part, pinned in other nodes' object stores (shared memory Ray caps at its
``object_store_memory`` and spills to disk beyond), reported, not held to the
worker's bound.
Every replica is the same, so one pipeline's ranks decide.

Sharded (``parallel.shard_optimizer``, dp > 1): a rank keeps the optimizer's state
for 1/dp of its parameters and the averaged gradient of that 1/dp (the
buckets are let go once reduce-scattered); its full gradients still fill up
during backward (micro-batches add into them). Its snapshot part, and so its
copies, are its slice of the weights and moments: 1/dp of them.

Activations: a stage keeps what autograd saved for a micro-batch (and, in a
pipeline, the stage's output) from that micro-batch's forward until its
backward. How many micro-batches are in that window at once is the
schedule's doing, read off torch.distributed.pipelining:

- no pipeline (``pp = 1``): the worker runs forward and backward of one
  micro-batch at a time (gradient accumulation): 1;
- ``gpipe``: every forward runs before the first backward: all ``m``;
- ``1f1b``: stage ``s`` runs ``min(m, pp - s)`` warm-up forwards, then one
  backward before each further forward: ``min(m, pp - s)``, so the first
  stage holds the most, up to ``pp``;
- ``interleaved``: rank ``r`` holding ``v`` virtual stages runs
  ``min(m v, (v - 1) m' + 2 (pp - 1 - r))`` warm-up forwards (``m'``: the
  micro-batches per round, ``m / max(1, m // pp)``), visiting its virtual
  stages ``m'`` micro-batches at a time, then a forward before each
  backward (``ScheduleInterleaved1F1B``). :func:`_interleaved_peak` walks
  that order, because the virtual stages differ in size, and takes the
  largest sum of live chunks.

With activation checkpointing (``train.activation_checkpointing: blocks``)
a block keeps only its input between forward and backward; its own saved
tensors exist again only while its backward recomputes it, one block at a
time, so the peak adds the largest block's saved tensors once. Activations
are sized in fp32 (the meta forward runs without autocast), an upper bound
for ``precision: bf16``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..optim.choice import is_elementwise, resolve, state_floats
from .layouts import Layout
from .model_shape import ModelShape

# The process before any model: a Ray worker with torch, this package, its groups and its data (VmRSS at
# set-up before the build, GPT and HF Llama alike, CPU build; a CUDA context adds device memory, not counted).
RUNTIME_BYTES = 400 << 20


@dataclass(frozen=True)
class MemoryModel:
    """What a run keeps per parameter of a rank's blocks, in bytes, by buffer (see the module's doc)."""

    weights: int = 4           # fp32 master weights
    grads: int = 4             # fp32 .grad
    optimizer: int = 8         # the optimizer's state: AdamW's exp_avg, exp_avg_sq (optim.choice.state_floats)
    buckets: int = 4           # fp32 flat bucket copies of the gradients (dp > 1 and an all-reduce)
    extra: int = 0             # error-feedback residual (4) or DiLoCo's outer copy and momentum (8)
    extra_alone: bool = False  # kept without replicas too (DiLoCo's; a residual needs a peer)
    snapshots_kept: int = 2    # local snapshot copies, each weights + moments, in host memory
    replicas: int = 2          # copies of each snapshot part in the nodes' object stores
    gpu: bool = False          # device memory apart from host memory
    runtime: int = RUNTIME_BYTES
    shard: str = "none"        # parallel.shard_optimizer in force (none, optimizer, gradients)

    @classmethod
    def of(cls, cfg, shard: str | None = None) -> "MemoryModel":
        """The model of a run's config (``TrainerConfig``); ``shard``: the sharding a layout runs with
        (default: the config's own, where it names one; ``auto`` is decided per layout, ``layout_shard``)."""
        c = cfg.comm
        # DiLoCo keeps the outer parameters and momentum; local SGD meeting in 2-byte floats the last
        # meeting's parameters; int8, top-k and PowerSGD an error-feedback residual.
        meeting = c.sync == "local_sgd" and c.compression != "none"
        extra = 8 if c.sync == "diloco" else 4 if meeting or c.compression in ("int8", "topk", "powersgd") else 0
        if shard is None:
            shard = cfg.parallel.shard_optimizer if cfg.parallel.shard_optimizer != "auto" else "none"
        o = cfg.train.optimizer
        optimizer = 8 if o.is_default else int(round(4 * state_floats(o.name, o.kwargs)))
        return cls(optimizer=optimizer, buckets=4 if c.sync == "allreduce" else 0, extra=extra,
                   extra_alone=c.sync == "diloco",
                   snapshots_kept=cfg.checkpoint.snapshots_kept, replicas=cfg.checkpoint.replicas,
                   gpu=cfg.scaling.uses_gpu, shard=shard)

    @property
    def snapshot_bytes(self) -> int:
        return self.snapshots_kept * (self.weights + self.optimizer)


@dataclass(frozen=True)
class RankMemory:
    """One pipeline rank's bytes, by buffer: ``device`` and ``host`` apart, ``bounded`` what a
    worker's memory bound holds (both on a CPU worker, the device's part on a GPU)."""

    weights: int
    grads: int
    optimizer: int
    buckets: int
    extra: int
    activations: int
    snapshots: int
    runtime: int
    gpu: bool = False
    object_store: int = 0   # the other replicas' copies of its parts, in other nodes' object stores
    parts_put: int = 0      # its own parts in its node's object store (counted in ``snapshots`` too)

    @property
    def store(self) -> int:
        """Object-store bytes of this rank's snapshots: its own parts and one node's share of the
        copies (each node holds about as many copies of others' parts as others hold of its)."""
        return self.parts_put + self.object_store

    @property
    def device(self) -> int:
        return self.weights + self.grads + self.optimizer + self.buckets + self.extra + self.activations

    @property
    def host(self) -> int:
        return self.snapshots + self.runtime + (0 if self.gpu else self.device)

    @property
    def bounded(self) -> int:
        return self.device if self.gpu else self.host

    @property
    def state(self) -> int:
        """The bounded bytes other than activations."""
        return self.bounded - self.activations

    def parts(self) -> dict[str, int]:
        """Each buffer's bytes, for ``elastic-trainer plan`` and the run report."""
        return {"weights": self.weights, "grads": self.grads, "optimizer": self.optimizer,
                "grad_buckets": self.buckets, "comm_state": self.extra, "activations": self.activations,
                "snapshots": self.snapshots, "runtime": self.runtime, "device": self.device, "host": self.host,
                "object_store": self.object_store}


def in_flight(schedule: str, m: int, pp: int, stage: int) -> int:
    """Micro-batches whose activations stage ``stage`` of a ``pp``-stage pipeline holds at its peak (not interleaved)."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return m
    return min(m, pp - stage)


def stage_activation_bytes(layout: Layout, shape: ModelShape, stage: int, checkpointing: bool = False) -> int:
    """Activation bytes one micro-batch leaves on pipeline stage ``stage`` until its backward (0 when unknown)."""
    if shape.saved_bytes is None:
        return 0
    a, b = layout.stage_bounds[stage]
    if checkpointing:
        # Each block keeps its input (block 0's, the token ids, is left out: a few bytes a token).
        saved = sum(shape.out_bytes[i - 1] for i in range(max(a, 1), b))
    else:
        saved = sum(shape.saved_bytes[a:b])
    # A pipeline stage also keeps its output for the backward that the next stage's gradient starts.
    return saved + (shape.out_bytes[b - 1] if layout.pp > 1 else 0)


def rank_memory(layout: Layout, shape: ModelShape, schedule: str, checkpointing: bool = False,
                model: MemoryModel = MemoryModel()) -> list[RankMemory]:
    """Each PP rank's bytes under ``layout`` (:class:`RankMemory`)."""
    counts = shape.param_counts
    out = []
    for r in range(layout.pp):
        stages = layout.stages_of(r)
        blocks = layout.blocks_of(r)
        n = sum(counts[b] for b in blocks)
        acts = [stage_activation_bytes(layout, shape, s, checkpointing) for s in stages]
        if len(stages) > 1:
            peak = _interleaved_peak(acts, layout.micro_batches, layout.pp, r)
        else:
            peak = acts[0] * in_flight(schedule, layout.micro_batches, layout.pp, r)
        if checkpointing and shape.saved_bytes is not None:
            peak += max(shape.saved_bytes[b] for b in blocks)  # the block being recomputed
        extra = model.extra if layout.dp > 1 or model.extra_alone else 0
        one = model.weights + model.optimizer + extra   # a snapshot's bytes a parameter (comm state too)
        kept = model.snapshots_kept
        if model.shard != "none" and layout.dp > 1:
            dp = layout.dp
            out.append(RankMemory(
                weights=n * model.weights, grads=n * model.grads, optimizer=n * model.optimizer // dp,
                buckets=n * model.buckets // dp, extra=0, activations=peak, runtime=model.runtime, gpu=model.gpu,
                # Its own slice alone: lent to the object store on a CPU, copied on a GPU.
                snapshots=(n * kept * one // dp if model.gpu else 0) + n * (kept + 1) * one // dp,
                object_store=n * (model.replicas - 1) * kept * one // dp, parts_put=n * (kept + 1) * one // dp))
            continue
        out.append(RankMemory(
            weights=n * model.weights, grads=n * model.grads, optimizer=n * model.optimizer,
            buckets=n * model.buckets if layout.dp > 1 else 0, extra=n * extra,
            # Local copies, except on a CPU rank that puts its whole state (no replica shares the parts):
            # it lends its live tensors (worker.snapshot_serving). The parts a rank puts into its node's
            # object store were written through its own mapping of the store: its resident set counts them,
            # the kept ones and the next while it is put.
            activations=peak, runtime=model.runtime, gpu=model.gpu,
            snapshots=(n * kept * one if model.gpu or layout.dp > 1 else 0) + n * (kept + 1) * one // layout.dp,
            object_store=n * (model.replicas - 1) * kept * one // layout.dp,
            parts_put=n * (kept + 1) * one // layout.dp))
    return out


def layout_shard(cfg, layout: Layout, shape: ModelShape, bound: float | None) -> str:
    """The optimizer sharding ``layout`` runs with under ``cfg`` (a ``TrainerConfig``): the one the
    config names; under ``auto``, ``gradients`` where the layout does not fit ``bound`` bytes a
    worker without it, else none. None at dp = 1 (nothing to shard with), and under ``auto`` where
    the gradient exchange cannot shard (local SGD, DiLoCo, the parameter server, int8, top-k,
    PowerSGD, an own all-reduce algorithm) or for an optimizer that is not elementwise (Adafactor)."""
    s, c = cfg.parallel.shard_optimizer, cfg.comm
    if layout.dp == 1 or s == "none":
        return "none"
    if s != "auto":
        return s
    if bound is None or c.sync != "allreduce" or c.compression not in ("none", "fp16", "bf16") or c.algorithm != "ring":
        return "none"
    if not cfg.train.optimizer.is_default and not is_elementwise(resolve(cfg.train.optimizer.name)):
        return "none"   # its update of a slice is not its update of the whole (optim.choice)
    checkpointing = cfg.train.activation_checkpointing == "blocks"
    need, _ = worker_memory(layout, shape, cfg.parallel.schedule, checkpointing, MemoryModel.of(cfg, "none"))
    return "none" if need <= bound else "gradients"


def worker_memory(layout: Layout, shape: ModelShape, schedule: str, checkpointing: bool = False,
                  model: MemoryModel = MemoryModel()) -> tuple[int, int]:
    """``(bounded bytes, activation bytes)`` of the rank of ``layout`` that needs the most memory."""
    top = max(rank_memory(layout, shape, schedule, checkpointing, model), key=lambda m: m.bounded)
    return top.bounded, top.activations


def _interleaved_peak(acts: list[int], m: int, pp: int, rank: int) -> int:
    """Peak live activation bytes of ``rank`` under torch's ``ScheduleInterleaved1F1B``; ``acts`` per local stage."""
    v = len(acts)
    per_round = m // max(1, m // pp)
    total = m * v
    warmup = min(total, (v - 1) * per_round + 2 * (pp - 1 - rank))

    def fwd(op: int) -> int:
        return (op // per_round) % v

    def bwd(op: int) -> int:
        return v - 1 - ((op - warmup) // per_round) % v

    live = sum(acts[fwd(op)] for op in range(warmup))
    peak = live
    for op in range(warmup, total):  # steady state: a forward, then a backward
        live += acts[fwd(op)]
        peak = max(peak, live)
        live -= acts[bwd(op)]
    return peak
