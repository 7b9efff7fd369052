"""Config sections of what is trained: run naming, the model, data, evaluation, the
optimizer and precision, and the dp x pp layout (``config.TrainerConfig`` joins them)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from .base import Strict as _Strict

_RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class RunSection(_Strict):
    """Naming and reporting."""

    name: str | None = Field(
        None, description="Run name; actors, the report file and the weights folder are named after it: "
                          "letters, digits, '.', '_' and '-', at most 100, starting with a letter or digit. "
                          "Default: et-<time>.")
    log_every: int = Field(10, ge=1, description="Print a progress line every N steps.")
    trackers: list[Literal["tensorboard", "mlflow"]] = Field(
        default_factory=list, description="Experiment trackers the driver writes the run's curves, events and "
                                          "config to (pip extra 'trackers'; docs/runtime.md, 'Trackers').")
    tensorboard_dir: str | None = Field(
        None, description="tensorboard: the run writes <dir>/<run>. Default: <report_dir>/tensorboard "
                          "(elastic_trainer_reports/tensorboard without a report_dir).")
    mlflow_tracking_uri: str | None = Field(
        None, description="mlflow: the tracking server or store. Default: MLflow's own (MLFLOW_TRACKING_URI, "
                          "else its local default).")
    mlflow_experiment: str | None = Field(
        None, description="mlflow: the experiment. Default: the run name up to its last '.' "
                          "('gpt-small.run1' -> 'gpt-small'), else 'elastic_trainer'.")

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
    secret_names: list[str] = Field(
        default_factory=list, description="More names (any case) whose values are secrets, besides the storages' "
                                          "credential names and names holding SECRET, TOKEN, PASSWORD, KEY or "
                                          "CREDENTIAL: an env_vars entry or URI parameter of such a name is masked "
                                          "in every record and reaches the workers by call, not runtime_env "
                                          "(docs/storage.md).")


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
        None, description="Weights the run starts from (fine-tuning), a local folder: a torch distributed "
                          "checkpoint (a folder with .metadata, e.g. from `elastic-trainer export --format dcp`; "
                          "any kind, by global parameter name), or for kind hf a save_pretrained folder, "
                          "whose config is used where hf_config is not set.")

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
        if self.hf_config is not None:
            raise ValueError(f"model.hf_config: transformers configs need model.kind 'hf', not {self.kind!r}")
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


class PrepareSection(_Strict):
    """data.prepare as a recipe: text tokenized into data.path where that is missing (as
    ``elastic-trainer prepare-data`` does), the tokenizer given or trained on the text."""

    input: str = Field("stdlib", description="The text: 'stdlib' (this Python's standard library source, a "
                                             "document per file), Parquet (column), .txt (a document per line) "
                                             "or .jsonl (column key); local path or pyarrow filesystem URI.")
    column: str = Field("text", description="The text column (Parquet) or key (.jsonl).")
    max_mb: float | None = Field(None, gt=0, description="input stdlib: read at most this many MiB (default 8).")
    tokenizer: str | None = Field(None, description="A tokenizer.json, a folder holding one, or a Hugging Face "
                                                    "hub name (fetched where the hub is reachable).")
    train_tokenizer: Literal["bpe", "unigram"] | None = Field(
        None, description="Train a tokenizer of this kind on the input instead (byte-level BPE or Unigram), "
                          "with vocab_size tokens; saved as <data.path>/_tokenizer.json.")
    vocab_size: int | None = Field(None, ge=2, description="train_tokenizer: its vocabulary; the model's "
                                                           "vocab_size must be at least this.")

    @model_validator(mode="after")
    def _check(self) -> "PrepareSection":
        if (self.tokenizer is None) == (self.train_tokenizer is None):
            raise ValueError(f"data.prepare needs one of tokenizer({self.tokenizer!r}) and "
                             f"train_tokenizer({self.train_tokenizer!r})")
        if (self.train_tokenizer is None) != (self.vocab_size is None):
            raise ValueError(f"data.prepare.vocab_size({self.vocab_size}) goes with train_tokenizer, and only "
                             "with it (a given tokenizer has its own)")
        return self


class DataSection(_Strict):
    """Token sequences in Parquet: one row per sequence of at least seq_len + 1 ids."""

    path: str = Field(..., description="Parquet file or directory; local path or pyarrow filesystem URI.")
    column: str = "tokens"
    seq_len: int = Field(128, ge=1)
    prepare: Literal["stdlib"] | PrepareSection | None = Field(
        None, description="'stdlib': build the byte corpus of Python's standard library at path if it is missing; "
                          "a recipe (input, tokenizer or train_tokenizer + vocab_size): tokenize text there.")
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
    skip_samples: list[list[int]] = Field(
        default_factory=list, description="[start, end) ranges of the global sample order never read (whole "
                                          "batches: multiples of train.global_batch_size); the run adds the "
                                          "batches it leaves out after an anomaly (integrity.on_anomaly).")


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


class OptimizerSection(_Strict):
    """The optimizer: a ``torch.optim`` class or a user's, its arguments, and parameter groups by
    name (docs/config.md, "Optimizer"). Checked against the class when the config is loaded."""

    name: str = Field("AdamW", min_length=1, description=(
        "A torch.optim class by name (AdamW, Adam, SGD, Adafactor, ...) or a user's class by import path "
        "('package.module:Class' or 'package.module.Class')."))
    kwargs: dict[str, Any] = Field(default_factory=dict, description=(
        "Arguments of the class (momentum, betas, fused, foreach, ...); not lr: train.lr is the peak the "
        "schedule scales."))
    param_groups: list[dict[str, Any]] = Field(default_factory=list, description=(
        "Groups of parameters with their own arguments: each has 'match' (a glob on the global parameter "
        "name, e.g. '*.bias') or 'regex' (searched in it) and the arguments it overrides, e.g. "
        "{match: '*.bias', weight_decay: 0.0}; a group's lr keeps its ratio to train.lr through the schedule. "
        "A parameter takes the first group that matches it, else the base arguments."))

    @property
    def is_default(self) -> bool:
        """AdamW with nothing of its own: the optimizer of configs older than this section."""
        return self.name == "AdamW" and not self.kwargs and not self.param_groups


class TrainSection(_Strict):
    """Optimisation: ``optimizer`` (AdamW by default); anything not set keeps torch's default."""

    steps: int = Field(100, ge=1)
    global_batch_size: int = Field(16, ge=1)
    micro_batch_size: int = Field(4, ge=1)
    lr: float = Field(3e-4, gt=0, description="Peak learning rate (after warm-up).")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="After warm-up: constant at lr, or cosine / linear decay from lr to min_lr "
                                "at the last step. A pure function of the step (train.lr_at).")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warm-up from lr / warmup_steps to lr.")
    min_lr: float = Field(0.0, ge=0, description="cosine / linear: the rate at the last step.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW's weight decay (its default 0.01 is AdamW's only); "
                                                         "another optimizer takes it where set otherwise.")
    betas: tuple[float, float] | None = None
    eps: float | None = Field(None, gt=0)
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
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

    @model_validator(mode="after")
    def _check_optimizer(self) -> "TrainSection":
        # The class is imported (torch.optim or the user's module) only when there is something to check.
        if not self.optimizer.is_default or self.betas is not None or self.eps is not None:
            from ..optim.build import check_train

            check_train(self)
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
    shard_optimizer: Literal["auto", "none", "optimizer", "gradients"] = Field(
        "auto", description="Shard over each stage's DP group: 'optimizer' (ZeRO-1) the optimizer state, each "
                            "rank updating 1/dp of the stage's parameters; 'gradients' (ZeRO-2) the "
                            "gradients as well, each freed once reduce-scattered; 'auto': 'gradients' on a "
                            "layout that does not fit scaling.worker_memory_gb without it, else none. "
                            "Elementwise optimizers only (AdamW, Adam, SGD, ...; not Adafactor): auto "
                            "does not shard another.")

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages one PP rank holds: ``virtual_stages`` when interleaved, else one."""
        return self.virtual_stages if self.schedule == "interleaved" else 1

    @property
    def num_stages(self) -> int:
        """Pipeline stages the model is cut into: ``pp * stages_per_rank``."""
        return self.pp * self.stages_per_rank
