"""Config sections of how a run runs: workers and placement, communication, checkpoints,
balancing around stragglers, and failure handling (``config.TrainerConfig`` joins them)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from .base import Strict as _Strict

# The sync modes whose replicas meet every comm.local_steps, and the codecs a meeting can send its change in.
MEETING_SYNCS = ("local_sgd", "diloco")
MEETING_CODECS = ("fp16", "bf16")


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
    placement_timeout_s: float = Field(120.0, gt=0, description="How long to wait for the cluster to fit the workers "
                                                                "(at the start, min_workers of them).")
    start_wait_s: float = Field(
        10.0, ge=0, description="At the start, wait this long for room for every worker of dp x pp; then start on "
                                "the workers that fit (at least min_workers, waited for up to placement_timeout_s), "
                                "on the layout the re-plan policy picks for them, and grow as nodes join.")
    torch_threads: int | None = Field(1, ge=1, description="torch.set_num_threads in CPU workers; None leaves torch's default.")
    env_vars: dict[str, str] = Field(
        default_factory=dict, description="Environment variables of the worker processes (NCCL_*, CUDA_*, ...), "
                                          "set through Ray's runtime_env.")
    cpu_allocator: Literal["jemalloc", "system"] = Field(
        "jemalloc", description="malloc of CPU workers: jemalloc (Ray's own copy, preloaded; freed memory is kept for "
                                "reuse, so a worker's resident memory stays at its working set's peak) or system "
                                "(the C library's). GPU workers keep the system's: their tensors are not malloc'd.")
    min_workers: int = Field(1, ge=1, description="Below this many live workers the run waits for nodes, then stops.")
    max_workers: int | None = Field(None, ge=1, description="Grow up to this many workers when nodes join; default: dp * pp.")
    worker_memory_gb: float | None = Field(
        None, gt=0, description="Memory a worker may use; plans that do not fit are not chosen. Default: what a "
                                "worker has: a GPU's memory, or a CPU worker's share of its node's memory.")
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
        "none", description="Gradient compression; int8, topk and powersgd keep an error-feedback residual. "
                            "With sync local_sgd or diloco, fp16 or bf16 sends each meeting's change since "
                            "the last one in 2-byte floats (half the bytes).")
    topk_ratio: float = Field(0.01, gt=0, le=1, description="topk: share of gradient entries sent.")
    topk_exchange: Literal["allgather", "sparse_reduce"] = Field(
        "allgather", description="topk: 'allgather' sends every rank's entries to every rank ((dp-1) x k per "
                                 "rank); 'sparse_reduce' scatters them by index range, sums, re-sparsifies to k "
                                 "and all-gathers (about 2 x k per rank at any dp).")
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
        meets = self.sync in MEETING_SYNCS
        if self.sync != "allreduce" and ((self.compression not in ("none", *(MEETING_CODECS if meets else ())))
                                         or self.algorithm != "ring"):
            fits = "'none', 'fp16' or 'bf16' (the meeting's change in 2-byte floats)" if meets else "'none'"
            raise ValueError(
                f"comm.compression({self.compression!r}) and comm.algorithm({self.algorithm!r}) apply to "
                f"comm.sync 'allreduce' only, not {self.sync!r}; leave the algorithm at 'ring' and the "
                f"compression at {fits}")
        return self


class CheckpointSection(_Strict):
    """Snapshots in the Ray object store and durable checkpoints on a filesystem."""

    memory_every: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="Snapshot into the object store every N steps; 'auto' measures what a snapshot "
                            "costs and picks the interval that keeps it under max_overhead of step time "
                            "(after a re-plan, estimated from the last choice and checked, or measured again).")
    max_overhead: float = Field(
        0.05, gt=0.0, le=1.0, description="With memory_every 'auto': the share of step time snapshots may cost.")
    overlap: bool = Field(
        True, description="Take snapshots off the critical path: the copy overlaps the next step, whose "
                          "optimizer update waits for it. false: the step waits for its own snapshot.")
    replicas: int = Field(2, ge=1, description="Copies of each snapshot shard, on distinct nodes, pinned.")
    snapshots_kept: int = Field(
        2, ge=1, description="Committed snapshots kept in the object store (with their pinned copies); each "
                             "worker keeps as many local copies, the newest. Older ones are let go.")
    host_memory_gb: float | None = Field(
        None, gt=0, description="Host memory per node for the workers' snapshot copy buffers (page-locked on a "
                                "GPU), shared equally by the workers the node fits; each worker sizes its "
                                "buffers within its share once and reuses them across re-plans. Copies past "
                                "it go to pageable memory. Unset: half the node's memory (Ray's 'memory').")
    verify_restores: bool = Field(
        False, description="Fingerprint every snapshot part (a pass over the state, off the step on the copy "
                           "thread; on the step where the state is lent) and check each restore against it, "
                           "tensor by tensor: the state a re-plan loads must be the state saved, bit for "
                           "bit, whatever the layouts. A difference fails the restore.")
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


class ControlSection(_Strict):
    """How the controller drives the steps."""

    lease_steps: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="Most steps a worker runs on its own per call of the controller (a lease): the "
                            "controller then gathers their results at once and acts between leases. A lease "
                            "ends at a snapshot step, an evaluation and the last step. 'auto': as many steps "
                            "as fit about a second at the measured step time (one a call during warm-up and "
                            "until a step time is measured), so the controller still acts within about a "
                            "second; 1 drives every step.")
    renew_early: bool = Field(
        True, description="Grant each rank its next lease while the current one runs, queued behind it (run "
                          "only if that one completes there), so no rank waits for the controller between "
                          "leases; false grants it once the last lease's results are all in.")


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
    heartbeat_timeout_s: float = Field(
        1.0, ge=0, description="After warm-up, a rank whose step runs on while it answers no heartbeat for this "
                               "long counts as lost (a frozen node, whose sockets stay open); 0 leaves it to "
                               "the step timeout.")
    heartbeat_fanout: int = Field(
        16, ge=2, description="Past this many nodes a heartbeat round, the controller asks one worker per this "
                              "many nodes to ask them and answer for them all, instead of asking each node "
                              "itself: its questions a round grow as nodes / fanout.")
    fence_timeout_s: float = Field(
        300.0, gt=0, description="A rank lost for silence is fenced out of the plan, not killed, and let back in as "
                                 "a spare when it answers again (a long pause, a loaded host, a slow link); one "
                                 "still silent this long after is killed.")
    keep_groups: bool = Field(
        True, description="gloo: a re-plan carries each DP and PP group whose members are the same, in the "
                          "same order, and which every member holds unbroken, instead of building it again; "
                          "false builds every group anew.")
    pin_timeout_s: float = Field(
        30.0, gt=0, description="A snapshot whose pinned copies are not all stored this long after its step is "
                                "dropped (its objects freed), and so is one whose pin fails.")
    storage_retries: int = Field(4, ge=0, description="Retries, with exponential backoff from 0.5 s, of a storage "
                                                      "read, write or listing that failed with an error a retry "
                                                      "may pass (not a refusal: credentials, a missing bucket); "
                                                      "at 4 an outage of about 10 s is waited out.")
    allow_fault_injection: bool = Field(
        False, description="Let clients inject faults into the workers (inject_fault, the slow-snapshot "
                           "environment hook): for chaos tests and demos; off in production runs.")
