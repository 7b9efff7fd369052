"""Bytes one worker holds under a layout: its parameters' state plus the activations its schedule keeps alive.

``memory = params * BYTES_PER_PARAM + peak activation bytes``, for the rank
that needs the most (every replica is the same, so one pipeline's ranks
decide).

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

from .layouts import Layout
from .model_shape import ModelShape

# What a worker keeps per parameter: fp32 weight and gradient, AdamW's two
# moments, and one snapshot copy in host memory. Left out, as they exist for
# some configs only: the error-feedback residual of int8/topk/powersgd and
# DiLoCo's outer copy and momentum (4 and 8 bytes more); a bound set close to
# the limit should leave room for them.
BYTES_PER_PARAM = 4 * 5


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


def rank_memory(layout: Layout, shape: ModelShape, schedule: str,
                checkpointing: bool = False) -> list[tuple[int, int]]:
    """``(state bytes, peak activation bytes)`` of each PP rank of ``layout``."""
    counts = shape.param_counts
    out = []
    for r in range(layout.pp):
        stages = layout.stages_of(r)
        blocks = layout.blocks_of(r)
        state = sum(counts[b] for b in blocks) * BYTES_PER_PARAM
        acts = [stage_activation_bytes(layout, shape, s, checkpointing) for s in stages]
        if len(stages) > 1:
            peak = _interleaved_peak(acts, layout.micro_batches, layout.pp, r)
        else:
            peak = acts[0] * in_flight(schedule, layout.micro_batches, layout.pp, r)
        if checkpointing and shape.saved_bytes is not None:
            peak += max(shape.saved_bytes[b] for b in blocks)  # the block being recomputed
        out.append((state, peak))
    return out


def worker_memory(layout: Layout, shape: ModelShape, schedule: str,
                  checkpointing: bool = False) -> tuple[int, int]:
    """``(total bytes, activation bytes)`` of the rank of ``layout`` that needs the most memory."""
    state, act = max(rank_memory(layout, shape, schedule, checkpointing), key=sum)
    return state + act, act


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
