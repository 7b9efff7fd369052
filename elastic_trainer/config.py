"""Run configuration: pydantic models that reject unknown keys, plus YAML loading.

Every cross-field rule is checked here, before any worker starts, and each
error names every factor involved (``dp(2) * pp(3) = 6 != num_workers(4)``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .config_parsing import apply_overrides, format_validation_error
from .errors import ConfigError

_RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSection(_Strict):
    """Naming and reporting."""

    name: str | None = Field(
        None, description="Run name; actors, the report file and the weights folder are named after it: "
                          "letters, digits, '.', '_' and '-', at most 100, starting with a letter or digit. "
                          "Default: et-<time>.")
    log_every: int = Field(10, ge=1, description="Print a progress line every N steps.")

    @model_validator(mode="after")
    def _check_name(self) -> "RunSection":
        # It becomes an actor name and a file name: no path separators, no spaces, nothing hidden.
        if self.name is not None and not _RUN_NAME_RE.match(self.name):
            raise ValueError(f"run.name({self.name!r}) must be letters, digits, '.', '_' or '-', at most 100, "
                             "starting with a letter or digit (e.g. 'gpt-small.run1')")
        return self

    report_dir: str | None = Field(
        "elastic_trainer_reports",
        description="Directory for the run report PNG (<dir>/<run>.png), written at the end of a run, "
                    "also when it fails. null: no report.")
    output_dir: str | None = Field(
        None, description="Where the final weights go (model.safetensors, by global parameter name); local "
                          "path or pyarrow filesystem URI. Default: <checkpoint.storage>/<run> when storage "
                          "is set, else <report_dir>/<run> (elastic_trainer_reports/<run> without a report_dir).")


class ModelSection(_Strict):
    """The model: the built-in byte-level GPT, a Hugging Face causal LM, or a user factory
    returning (blocks, loss_fn)."""

    kind: Literal["gpt", "factory", "hf"] = "gpt"
    n_layer: int = Field(4, ge=1)
    n_head: int = Field(4, ge=1)
    d_model: int = Field(128, ge=1)
    seq_len: int | None = Field(None, ge=1, description="Context length; default: data.seq_len.")
    vocab_size: int = Field(256, ge=2)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    factory: str | None = Field(None, description='"package.module:function" returning (blocks, loss_fn).')
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the factory.")
    hf_config: dict[str, Any] | str | None = Field(
        None, description="kind hf: a transformers config, as a dict (with model_type, e.g. 'llama', 'gpt2') "
                          "or the path of a config.json or of a folder holding one. Nothing is fetched from a hub.")
    init_from: str | None = Field(
        None, description="kind hf: a local save_pretrained folder whose weights the run starts from "
                          "(fine-tuning); its config is used where hf_config is not set.")

    @model_validator(mode="after")
    def _check(self) -> "ModelSection":
        if self.kind == "hf":
            if self.hf_config is None and self.init_from is None:
                raise ValueError("model.kind 'hf' needs model.hf_config (a config dict or config.json path) "
                                 "or model.init_from (a save_pretrained folder)")
            if isinstance(self.hf_config, dict) and "model_type" not in self.hf_config:
                raise ValueError("model.hf_config needs a model_type (e.g. 'llama' or 'gpt2'); "
                                 f"given keys: {sorted(self.hf_config)}")
            if self.factory is not None:
                raise ValueError("model.factory is for kind 'factory'; kind 'hf' builds from model.hf_config")
            return self
        if self.hf_config is not None or self.init_from is not None:
            raise ValueError(f"model.hf_config and model.init_from need model.kind 'hf', not {self.kind!r}")
        if self.factory is not None:
            if not _FACTORY_RE.match(self.factory):
                raise ValueError(
                    f"model.factory({self.factory!r}) is not of the form 'package.module:function'"
                )
            if self.kind != "factory":
                object.__setattr__(self, "kind", "factory")
        elif self.kind == "factory":
            raise ValueError("model.kind is 'factory' but model.factory is not set")
        if self.kind == "gpt" and self.d_model % self.n_head:
            raise ValueError(
                f"model.d_model({self.d_model}) is not divisible by model.n_head({self.n_head})"
            )
        return self


class DataSection(_Strict):
    """Token sequences in Parquet: one row per sequence of at least seq_len + 1 ids."""

    path: str = Field(..., description="Parquet file or directory; local path or pyarrow filesystem URI.")
    column: str = "tokens"
    seq_len: int = Field(128, ge=1)
    prepare: Literal["stdlib"] | None = Field(
        None, description="'stdlib': build the byte corpus of Python's standard library at path if it is missing."
    )
    shuffle: bool = Field(
        True, description="Shuffle windows per epoch, seeded. A corpus whose decoded tokens fit in read_ahead_mb "
                          "is fully permuted; a larger one by blocks of shuffle_block consecutive windows in a "
                          "seeded order, the windows of every shuffle_mix blocks mixed together (so a step reads "
                          "a few row groups, not one per sample).")
    shuffle_block: int = Field(16, ge=1, description="Consecutive windows kept together by the shuffle of a corpus "
                                                     "larger than read_ahead_mb.")
    shuffle_mix: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="Blocks whose windows the shuffle mixes with each other; auto: as many as the "
                            "read-ahead holds row groups of (at least 16).")
    read_ahead_mb: float = Field(
        256.0, gt=0, description="Decoded row groups a reading rank keeps (and reads ahead into), MiB: "
                                 "its memory for data is bounded by this, not by the corpus.")


class EvalSection(_Strict):
    """Validation loss, on held-out data, every ``every`` steps on the current plan."""

    path: str | None = Field(None, description="Parquet of validation rows (same column and format as data.path).")
    fraction: float | None = Field(
        None, gt=0, lt=1, description="Hold out this share of data.path's windows instead (the last ones "
                                      "of the stream): training never reads them.")
    every: int | None = Field(None, ge=1, description="Evaluate after every N steps (and after the last); "
                                                       "None: no evaluation.")
    batches: int = Field(4, ge=1, description="Global batches (train.global_batch_size windows each) per evaluation.")

    @model_validator(mode="after")
    def _check(self) -> "EvalSection":
        if self.path is not None and self.fraction is not None:
            raise ValueError(f"eval.path({self.path!r}) and eval.fraction({self.fraction}) both given; set one")
        if self.every is not None and self.path is None and self.fraction is None:
            raise ValueError(f"eval.every({self.every}) needs eval.path or eval.fraction")
        return self

    @property
    def enabled(self) -> bool:
        return self.every is not None


class TrainSection(_Strict):
    """Optimisation. AdamW; anything not set keeps torch's default."""

    steps: int = Field(100, ge=1)
    global_batch_size: int = Field(16, ge=1)
    micro_batch_size: int = Field(4, ge=1)
    lr: float = Field(3e-4, gt=0, description="Peak learning rate (after warm-up).")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="After warm-up: constant at lr, or cosine / linear decay from lr to min_lr "
                                "at the last step. A pure function of the step (train.lr_at).")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warm-up from lr / warmup_steps to lr.")
    min_lr: float = Field(0.0, ge=0, description="cosine / linear: the rate at the last step.")
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] | None = None
    eps: float | None = Field(None, gt=0)
    seed: int = 0
    grad_clip: float | None = Field(None, gt=0)
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="fp32; bf16 / fp16: forward (and the loss) under autocast to bfloat16 / float16, "
                            "with fp32 parameters, gradients and AdamW moments; fp16 with dynamic loss scaling.")
    loss_scale_init: float = Field(65536.0, gt=0, description="fp16: the loss scale to start from.")
    loss_scale_growth_interval: int = Field(
        2000, ge=1, description="fp16: good steps in a row after which the loss scale doubles (a step with "
                                "an inf or NaN gradient is skipped on every rank and halves it).")
    @model_validator(mode="after")
    def _check_schedule(self) -> "TrainSection":
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr({self.min_lr}) > train.lr({self.lr})")
        if self.warmup_steps >= self.steps and self.lr_schedule != "constant":
            raise ValueError(f"train.warmup_steps({self.warmup_steps}) leaves no decay in train.steps({self.steps}) "
                             f"for lr_schedule {self.lr_schedule!r}")
        return self

    activation_checkpointing: Literal["none", "blocks"] = Field(
        "none", description="blocks: keep only each block's input in forward and recompute the block in "
                            "backward (torch's non-reentrant checkpoint): less activation memory, one more "
                            "forward per block.")


class ParallelSection(_Strict):
    """How the workers split the model (pp) and the batch (dp)."""

    dp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    virtual_stages: int = Field(2, ge=1, description="Stages per rank for the interleaved schedule.")

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages one PP rank holds: ``virtual_stages`` when interleaved, else one."""
        return self.virtual_stages if self.schedule == "interleaved" else 1

    @property
    def num_stages(self) -> int:
        """Pipeline stages the model is cut into: ``pp * stages_per_rank``."""
        return self.pp * self.stages_per_rank


class ScalingSection(_Strict):
    """Where workers run."""

    num_workers: int | None = Field(None, ge=1, description="Default: dp * pp.")
    resources_per_worker: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0})
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    workers_per_node: int | None = Field(
        None, ge=1, description="Default: one per GPU on GPU workers, one per node on CPU workers."
    )
    replica_placement: Literal["spread", "pack", "strict_spread"] = Field(
        "spread",
        description="spread: a stage's replicas on different nodes (a live replica survives a node loss) where "
        "the cluster has the nodes, else packed onto the nodes there are, said in one line at the start; "
        "strict_spread: wait (up to placement_timeout_s) for one node per worker rather than pack; "
        "pack: a stage's replicas share a node (gradient all-reduce stays on the node).",
    )
    placement_timeout_s: float = Field(120.0, gt=0, description="How long to wait for the cluster to fit the workers.")
    torch_threads: int | None = Field(1, ge=1, description="torch.set_num_threads in CPU workers; None leaves torch's default.")
    env_vars: dict[str, str] = Field(
        default_factory=dict, description="Environment variables of the worker processes (NCCL_*, CUDA_*, ...), "
                                          "set through Ray's runtime_env.")
    min_workers: int = Field(1, ge=1, description="Below this many live workers the run waits for nodes, then stops.")
    max_workers: int | None = Field(None, ge=1, description="Grow up to this many workers when nodes join; default: dp * pp.")
    worker_memory_gb: float | None = Field(None, gt=0, description="Memory a worker may use; plans that do not fit are not chosen. Default: no bound.")
    grow_check_s: float = Field(5.0, gt=0, description="How often to look for new nodes at step boundaries.")

    @property
    def uses_gpu(self) -> bool:
        return self.resources_per_worker.get("GPU", 0) > 0

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.uses_gpu else "gloo"


class CommSection(_Strict):
    """Gradient communication across data-parallel replicas."""

    bucket_mb: float = Field(25.0, gt=0, description="All-reduce bucket size in MiB.")
    timeout_s: float = Field(300.0, gt=0, description="Timeout of every collective.")
    overlap: bool = Field(True, description="Start a bucket's all-reduce as soon as its gradients are ready "
                                            "(during backward) instead of after it.")
    algorithm: Literal["ring", "tree", "chunked"] = Field(
        "ring", description="All-reduce: the backend's ring, or the project's own tree (recursive "
                            "halving-doubling) or chunked ring over point-to-point operations.")
    compression: Literal["none", "fp16", "bf16", "int8", "topk", "powersgd"] = Field(
        "none", description="Gradient compression; int8, topk and powersgd keep an error-feedback residual.")
    topk_ratio: float = Field(0.01, gt=0, le=1, description="topk: share of gradient entries sent.")
    topk_warmup_steps: int = Field(
        0, ge=0, description="topk: steps over which the share sent falls geometrically from 25% to "
                             "topk_ratio (sparsity warm-up, as in Deep Gradient Compression); 0: none.")
    powersgd_rank: int = Field(4, ge=1, description="powersgd: rank of the low-rank approximation.")
    powersgd_start_step: int = Field(10, ge=0, description="powersgd: plain all-reduce before this step.")
    sync: Literal["allreduce", "local_sgd", "diloco", "parameter_server"] = Field(
        "allreduce", description="allreduce every step; local_sgd / diloco: average the model every "
                                 "local_steps steps; parameter_server: sharded parameter-server actors.")
    local_steps: int = Field(8, ge=1, description="local_sgd / diloco: steps between model averages.")
    outer_lr: float = Field(0.7, gt=0, description="diloco: learning rate of the outer Nesterov step.")
    # The DiLoCo paper's 0.9 suits hundreds of inner steps; with a few it overshoots
    # (demo GPT, local_steps 4, 60 steps: 0.9 ends 10% behind all-reduce, 0.5 within 1.1%).
    outer_momentum: float = Field(0.5, ge=0, lt=1, description="diloco: momentum of the outer Nesterov step.")
    ps_shards: int = Field(2, ge=1, description="parameter_server: number of parameter-server actors.")
    constants: str | None = Field(
        None, description="A constants JSON from `elastic-trainer bench-comm --out`; the planner and the re-plan "
                          "after a failure use it. Default: the built-in constants.")

    @model_validator(mode="after")
    def _check(self) -> "CommSection":
        if self.algorithm != "ring" and self.compression not in ("none", "fp16", "bf16"):
            raise ValueError(f"comm.algorithm({self.algorithm!r}) replaces an all-reduce; comm.compression"
                             f"({self.compression!r}) is built from all-to-all / all-gather: use algorithm 'ring', "
                             "or compression none, fp16 or bf16")
        if self.sync != "allreduce" and (self.compression != "none" or self.algorithm != "ring"):
            raise ValueError(
                f"comm.compression({self.compression!r}) and comm.algorithm({self.algorithm!r}) apply to "
                f"comm.sync 'allreduce' only, not {self.sync!r}; leave them at 'none' and 'ring'")
        return self


class CheckpointSection(_Strict):
    """Snapshots in the Ray object store and durable checkpoints on a filesystem."""

    memory_every: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="Snapshot into the object store every N steps; 'auto' measures what a snapshot "
                            "costs and picks the interval that keeps it under max_overhead of step time "
                            "(measured again after every re-plan).")
    max_overhead: float = Field(
        0.05, gt=0.0, le=1.0, description="With memory_every 'auto': the share of step time snapshots may cost.")
    overlap: bool = Field(
        True, description="Take snapshots off the critical path: the copy overlaps the next step, whose "
                          "optimizer update waits for it. false: the step waits for its own snapshot.")
    replicas: int = Field(2, ge=1, description="Copies of each snapshot shard, on distinct nodes, pinned.")
    snapshots_kept: int = Field(
        2, ge=1, description="Committed snapshots kept in the object store (with their pinned copies); each "
                             "worker keeps as many local copies, the newest. Older ones are let go.")
    durable_every: int | None = Field(None, ge=1, description="Write a durable checkpoint every N steps (and at the end).")
    storage: str | None = Field(None, description="Directory or pyarrow filesystem URI for durable checkpoints.")
    keep_durable: int = Field(3, ge=1, description="Durable checkpoints kept; older ones are deleted.")


class BalanceSection(_Strict):
    """Stragglers: each rank's own pace, and what a slow one triggers (controller.pace)."""

    mode: Literal["off", "detect", "act"] = Field(
        "act", description="off: no pace is kept; detect: per-rank pace in history, metrics, status, and a "
                           "straggler event when a rank stays slow; act: also rebalance around a straggler "
                           "(controller.balance) where the cost model says it repays, and undo it when the "
                           "rank recovers.")
    threshold: float = Field(0.15, gt=0, description="A rank whose median pace over the window is this much "
                                                     "slower than its peers' is a straggler.")
    window: int = Field(10, ge=2, description="Steps the pace's median is taken over (a shorter slowdown is a blip).")
    payback_steps: int = Field(
        50, ge=1, description="act: a mitigation is taken only when the time it is predicted to save per step, "
                              "over this many steps, exceeds what taking it costs.")


class FailureSection(_Strict):
    """Detection and recovery."""

    max_failures: int = Field(3, ge=0, description="Recoveries allowed before the run stops.")
    retries: int = Field(1, ge=0, description="Retries of a step whose collective failed while every worker lived.")
    wait_for_nodes_s: float = Field(60.0, ge=0, description="Below min_workers, wait this long for nodes.")
    startup_timeout_s: float = Field(120.0, gt=0, description="Step timeout until warm-up is over.")
    warmup_steps: int = Field(3, ge=1, description="Steps after a (re)start that use the start-up timeout.")
    step_timeout_factor: float = Field(10.0, gt=1, description="After warm-up a step may take this multiple of the median step time.")
    min_step_timeout_s: float = Field(5.0, gt=0, description="Floor of the tightened step timeout.")
    rendezvous_timeout_s: float = Field(30.0, gt=0, description="How long ranks wait for each other when (re)joining process groups.")
    ping_timeout_s: float = Field(1.0, gt=0, description="A worker that does not answer a ping in this long counts as lost.")
    pin_timeout_s: float = Field(
        30.0, gt=0, description="A snapshot whose pinned copies are not all stored this long after its step is "
                                "dropped (its objects freed), and so is one whose pin fails.")
    storage_retries: int = Field(3, ge=0, description="Retries, with exponential backoff, of a durable write or "
                                                      "read that failed with a storage error.")
    allow_fault_injection: bool = Field(
        False, description="Let clients inject faults into the workers (inject_fault, the slow-snapshot "
                           "environment hook): for chaos tests and demos; off in production runs.")


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
