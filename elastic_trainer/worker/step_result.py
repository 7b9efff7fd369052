"""What one rank's step reports: its loss, its times and bytes, its own pace (``StageTrainer.train_step``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepResult:
    step: int
    loss: float | None  # mean micro-batch loss; only ranks holding the last stage know it
    compute_s: float
    comm_s: float          # seconds in collectives, hidden or not
    comm_bytes: int        # bytes this rank sent
    cursor: int  # global index of the step's first sample
    exposed_comm_s: float = 0.0  # seconds the step waited for communication
    loss_scale: float | None = None  # fp16: the scale this step's loss was multiplied by
    skipped: bool = False            # fp16: a gradient overflowed on some rank, so no rank applied the step
    dense_bytes: int = 0   # what an uncompressed all-reduce of every gradient would have sent
    snapshot_wait_s: float = 0.0  # the update waited this long for the previous step's snapshot
    lr: float = 0.0               # the learning rate of this step's update (lr_schedule.lr_at)
    # This rank's own pace (worker.compute_clock): its passes and update, apart from its waits.
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    wait_s: float = 0.0           # the rest of the step: pipeline receives, collectives, data
    micro_batches: int = 0        # this replica's share of the step's micro-batches
    passes_steady_s: float = 0.0  # forward + backward at each pass's steady cost (compute_clock)
    passes_shape: dict | None = None  # what pricing them at another count needs (compute_clock.pass_shape)
    grad_norm: float | None = None    # the global gradient norm, agreed over every rank (None: not applied)
    anomaly: dict | None = None       # this attempt was judged anomalous (integrity): applied nowhere
    anomalies: list | None = None     # the attempts at this step skipped before it (on_anomaly: skip)
    fingerprints: dict | None = None  # a check step's: what this rank holds after it (worker.state_checks)
    check_s: float = 0.0              # and what taking them cost
    verdict_s: float = 0.0            # the step's verdict: its sums and its one small all-reduce
