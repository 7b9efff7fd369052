"""What a rank tells the controller of a step it ran: the step's figures, its snapshot's, its memory's."""

from __future__ import annotations

import time

import torch

from .memory_use import cuda_peak_bytes, peak_rss_bytes, reset_peaks


def anomaly_answer(rank: int, e) -> dict:
    """What a rank answers for a step judged anomalous and not skipped (``integrity.anomaly``'s
    ``StepAnomaly``): applied nowhere, its lease ended after it."""
    return {"rank": rank, "anomaly_mark": True, "step": e.step, "anomaly": e.anomaly, "cursor": e.cursor}


def step_answer(rank: int, r, snapshot_bytes: int, buffer_bytes: int, copied, t0: float,
                device: torch.device) -> dict:
    """The answer of a step call (``r``: the ``StepResult``; ``t0``: when the call began). Reads
    the step's peak memory and starts the next step's from what is resident now."""
    peak, peak_device = peak_rss_bytes(), cuda_peak_bytes(device)
    reset_peaks(device)
    return {"rank": rank, "loss": r.loss, "compute_s": r.compute_s, "comm_time_s": r.comm_s,
            "exposed_comm_s": r.exposed_comm_s, "comm_bytes": r.comm_bytes, "dense_bytes": r.dense_bytes,
            "cursor": r.cursor, "loss_scale": r.loss_scale, "skipped": r.skipped,
            "snapshot_wait_s": r.snapshot_wait_s, "lr": r.lr, "forward_s": r.forward_s,
            "backward_s": r.backward_s, "optimizer_s": r.optimizer_s, "wait_s": r.wait_s,
            "micro_batches": r.micro_batches, "passes_steady_s": r.passes_steady_s,
            "passes_shape": r.passes_shape, "grad_norm": r.grad_norm, "anomalies": r.anomalies or [],
            "fingerprints": r.fingerprints, "check_s": r.check_s, "verdict_s": r.verdict_s,
            "snapshot_bytes": snapshot_bytes, "snapshot_buffer_bytes": buffer_bytes, "copied": copied,
            # The whole call here (what the controller's driving cannot save, the rank's own
            # Python between its passes included).
            "call_s": time.perf_counter() - t0,
            # The peak resident memory since the last step's (and the device's, on a GPU).
            "peak_rss_bytes": peak, "peak_device_bytes": peak_device,
            "ended_at": time.time()}   # wall clock: how long the next step's grant kept it waiting
