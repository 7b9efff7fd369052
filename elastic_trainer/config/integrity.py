"""Config of what guards a run against bad steps: non-finite and spiking losses and gradient norms
(``integrity.on_anomaly``), and the checks that replicas still hold the same state."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from .base import Strict as _Strict


class IntegritySection(_Strict):
    """Each step's loss and gradient norm are judged on every rank (the verdict agreed over the
    world in the step's one small all-reduce); an anomalous step is never applied."""

    on_anomaly: Literal["skip", "rollback", "stop"] = Field(
        "skip", description="A non-finite or spiking step: skip (its update dropped, its batch left out, the step "
                            "run again on the next batch), rollback (back to the newest snapshot before it, the "
                            "batches since left out), or stop (the run ends with an error, the last good step "
                            "saved).")
    spikes: list[Literal["loss", "grad_norm"]] = Field(
        default_factory=lambda: ["loss"],
        description="The signals judged for spikes; [] judges non-finite values only. grad_norm is not judged "
                    "by default: in healthy training it jumps 10x and more (clipping is its remedy).")
    spike_window: int = Field(50, ge=5, description="Accepted steps whose median a value is judged against.")
    spike_min_history: int = Field(20, ge=3, description="No spike is judged before this many steps are in the window.")
    spike_mads: float = Field(6.0, gt=0, description="A spike exceeds the median by this many scaled median "
                                                     "absolute deviations (1.4826 MAD)...")
    spike_ratio_loss: float = Field(1.5, gt=1, description="...and a loss is above this multiple of the median...")
    spike_ratio_grad_norm: float = Field(
        10.0, gt=1, description="...and a gradient norm above this one: a norm swings far more than a loss does "
                                "in healthy training (4x in a step, measured on small GPTs), so only a jump an "
                                "order of magnitude above its median is taken for a spike.")
    max_anomalies: int = Field(5, ge=1, description="More anomalies than this within anomaly_window steps end the "
                                                    "run (as stop does) rather than skip or roll back again.")
    anomaly_window: int = Field(100, ge=1, description="Steps over which max_anomalies counts.")
    check_every: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="Every N steps (and at every snapshot step) the replicas of each stage compare "
                            "fingerprints of their parameters and optimizer state, and a sharded optimizer's ranks "
                            "checksum their slices at rest; auto: as often as keeps the checks' cost under "
                            "check_max_overhead of the step time; 0: never.")
    check_max_overhead: float = Field(0.01, gt=0, lt=1, description="check_every auto: the checks' share of the "
                                                                  "step time they may cost.")

    @model_validator(mode="after")
    def _window(self) -> "IntegritySection":
        if self.spike_min_history > self.spike_window:
            raise ValueError(f"integrity.spike_min_history({self.spike_min_history}) > "
                             f"spike_window({self.spike_window}): no window would ever hold enough steps")
        return self
