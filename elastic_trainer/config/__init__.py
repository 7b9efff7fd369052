"""Run configuration: the whole run's pydantic model, its cross-section rules, and YAML loading.

The sections are in ``config.training`` (what is trained) and
``config.runtime`` (how it runs), and are importable from here. Every
cross-field rule is checked before any worker starts, and each error names
every factor involved (``dp(2) * pp(3) = 6 != num_workers(4)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from .base import Strict as _Strict
from .parsing import apply_overrides, format_validation_error
from .integrity import IntegritySection  # noqa: F401
from .runtime import (BalanceSection, CheckpointSection, CommSection, ControlSection,  # noqa: F401
                             FailureSection, ScalingSection)
from .training import (DataSection, EvalSection, ModelSection, ParallelSection,  # noqa: F401
                              PrepareSection, RunSection, TrainSection)
from ..errors import ConfigError
from ..storage.credentials import take_credentials
from ..secrets import remember_names


def _check_prepared_vocab(model: ModelSection, data: DataSection) -> None:
    """A tokenizer trained by data.prepare has a known size: a smaller model vocabulary fails here."""
    prep = data.prepare
    size = getattr(prep, "vocab_size", None)
    if size is None:
        return
    vocab, field = model.vocab_size, "model.vocab_size"
    if model.kind == "hf":
        vocab = model.hf_config.get("vocab_size") if isinstance(model.hf_config, dict) else None
        field = "model.hf_config.vocab_size"
    elif model.kind != "gpt":
        return   # a factory's vocabulary is its own
    if vocab is not None and vocab < size:
        raise ValueError(f"{field}({vocab}) is smaller than the tokenizer data.prepare trains "
                         f"(vocab_size {size}): set {field} to {size}")


class TrainerConfig(_Strict):
    """The whole run. Load with :meth:`from_yaml` or ``TrainerConfig.model_validate(dict)``."""

    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    balance: BalanceSection = Field(default_factory=BalanceSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    scaling: ScalingSection = Field(default_factory=ScalingSection)
    comm: CommSection = Field(default_factory=CommSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    failure: FailureSection = Field(default_factory=FailureSection)
    control: ControlSection = Field(default_factory=ControlSection)
    integrity: IntegritySection = Field(default_factory=IntegritySection)

    @model_validator(mode="before")
    @classmethod
    def _credentials_out(cls, raw: Any) -> Any:
        # A config never holds a secret: credentials written into a URI go to the run's
        # environment here, so no record of the config (manifest, report, event) can carry them.
        if not isinstance(raw, dict):
            return raw
        run = raw.get("run")
        names = run.get("secret_names") if isinstance(run, dict) else getattr(run, "secret_names", None)
        if isinstance(names, list):
            remember_names(n for n in names if isinstance(n, str))   # before any URI is split or masked
        return take_credentials(raw)

    @model_validator(mode="after")
    def _cross_checks(self) -> "TrainerConfig":
        p, t, s = self.parallel, self.train, self.scaling
        world = p.dp * p.pp
        if s.num_workers is not None and s.num_workers != world:
            raise ValueError(f"dp({p.dp}) * pp({p.pp}) = {world} != num_workers({s.num_workers})")
        per_step = p.dp * t.micro_batch_size
        if t.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size({t.global_batch_size}) is not divisible by "
                f"dp({p.dp}) * micro_batch_size({t.micro_batch_size}) = {per_step}"
            )
        n_micro = t.global_batch_size // per_step
        if s.max_workers is not None and s.max_workers < world:
            raise ValueError(f"scaling.max_workers({s.max_workers}) < dp({p.dp}) * pp({p.pp}) = {world}")
        if s.min_workers > world:
            raise ValueError(f"scaling.min_workers({s.min_workers}) > dp({p.dp}) * pp({p.pp}) = {world}")
        if t.precision == "fp16" and (self.comm.sync != "allreduce" or self.comm.compression not in ("none", "fp16", "bf16")):
            raise ValueError(
                f"train.precision 'fp16' skips steps whose gradients overflow, which comm.sync({self.comm.sync!r}) "
                f"with comm.compression({self.comm.compression!r}) cannot undo (error feedback, local steps or "
                "parameter-server updates would keep the overflow): use sync 'allreduce' with compression none, "
                "fp16 or bf16, or precision 'bf16'")
        if p.shard_optimizer in ("optimizer", "gradients"):
            comm = self.comm
            if comm.sync != "allreduce" or comm.compression not in ("none", "fp16", "bf16") or comm.algorithm != "ring":
                raise ValueError(
                    f"parallel.shard_optimizer({p.shard_optimizer!r}) reduce-scatters the gradients and "
                    f"all-gathers the parameters every step; comm.sync({comm.sync!r}), "
                    f"comm.compression({comm.compression!r}) and comm.algorithm({comm.algorithm!r}) do not: "
                    "use sync 'allreduce', algorithm 'ring' and compression none, fp16 or bf16 "
                    "(docs/communication.md, 'Sharded optimizer state')")
        if p.shard_optimizer in ("optimizer", "gradients") and not t.optimizer.is_default:
            from ..optim.choice import check_spec

            check_spec(t.optimizer.name, {}, [], {}, p.shard_optimizer)   # elementwise optimizers only
        c = self.checkpoint
        if c.durable_every is not None and c.storage is None:
            raise ValueError(f"checkpoint.durable_every({c.durable_every}) needs checkpoint.storage")
        if p.schedule == "1f1b" and p.pp > 1 and n_micro < p.pp:
            raise ValueError(
                f"schedule '1f1b' needs at least as many micro-batches per replica as stages: "
                f"global_batch_size({t.global_batch_size}) / (dp({p.dp}) * micro_batch_size({t.micro_batch_size})) "
                f"= {n_micro} < pp({p.pp}); lower micro_batch_size or dp, or use schedule 'gpipe'")
        if p.schedule == "interleaved":
            if p.pp < 2:
                raise ValueError(f"schedule 'interleaved' needs pp >= 2, got pp({p.pp})")
            rounds = max(1, n_micro // p.pp)
            if n_micro % rounds:
                raise ValueError(
                    f"schedule 'interleaved' needs micro-batches per replica({n_micro}) to be a multiple "
                    f"of max(1, micro-batches // pp({p.pp})) = {rounds}; try a multiple of pp"
                )
        _check_prepared_vocab(self.model, self.data)
        if self.data.skip_samples:
            from .sample_ranges import check_ranges

            object.__setattr__(self.data, "skip_samples", [list(r) for r in check_ranges(
                self.data.skip_samples, t.global_batch_size)])
        if self.model.kind == "gpt":
            if self.model.seq_len is None:
                object.__setattr__(self.model, "seq_len", self.data.seq_len)
            elif self.data.seq_len > self.model.seq_len:
                raise ValueError(
                    f"data.seq_len({self.data.seq_len}) > model.seq_len({self.model.seq_len}): "
                    "the model has no position for the extra tokens"
                )
            n_blocks = self.model.n_layer + 2
            stages = p.num_stages
            if n_blocks < stages:
                raise ValueError(
                    f"the GPT has {n_blocks} blocks (n_layer({self.model.n_layer}) + embedding + head), "
                    f"fewer than the {stages} pipeline stages asked for"
                )
        return self

    # -- derived values -------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.parallel.dp * self.parallel.pp

    @property
    def max_workers(self) -> int:
        return self.scaling.max_workers or self.world_size

    @property
    def micro_batches(self) -> int:
        """Micro-batches each replica runs per step: global_batch / (dp * micro_batch)."""
        return self.train.global_batch_size // (self.parallel.dp * self.train.micro_batch_size)

    # -- loading ----------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> "TrainerConfig":
        """Load a job file; ``overrides`` are ``section.key=value`` strings applied on top."""
        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"job file {str(path)!r} does not exist") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"job file {str(path)!r} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"job file {str(path)!r} must hold a mapping of sections, got {type(raw).__name__}")
        return cls.from_dict(apply_overrides(raw, overrides or []), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "TrainerConfig":
        """Validate a plain dict, turning pydantic's errors into one ConfigError."""
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, source, cls)) from None

    def with_overrides(self, overrides: list[str]) -> "TrainerConfig":
        return self.from_dict(apply_overrides(self.model_dump(mode="json"), overrides))
