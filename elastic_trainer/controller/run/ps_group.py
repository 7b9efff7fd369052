"""The parameter-server shards of a ``comm.sync: parameter_server`` run, as the controller sees them.

The shards live on the controller's node: they hold the only copy of the
AdamW state, so they must not share the fate of the (preemptible) worker
nodes, and a run does not outlive its controller anyway. Their state is
snapshotted with the workers' (same steps, refs owned by the controller), and
a recovery puts them back at the step the workers restore.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ...comm.parameter_server import assign_shards, remote_shard_class
from ...config import ModelSection, TrainerConfig
from ...models.build import build_own_blocks
from ...models.factory import build_blocks_for_shapes
from ...naming import NAMESPACE


@ray.remote(num_cpus=0, max_retries=0)
def _initial_params(model_json: dict, seed: int, names: list[str]) -> dict:
    """A shard's first values, made where the shard lives: only the blocks that hold its names,
    each from its own seed, as every worker makes its own (``build_own_blocks``)."""
    blocks = sorted({int(n.split(".")[1]) for n in names})
    built, _, _, _ = build_own_blocks(ModelSection.model_validate(model_json), seed, blocks)
    want = set(names)
    return {f"blocks.{i}.{n}": p.detach().numpy() for i, b in built.items() for n, p in b.named_parameters()
            if f"blocks.{i}.{n}" in want}


class ParameterServers:
    def __init__(self, cfg: TrainerConfig, run_name: str, node_id: str, dp: int):
        # The controller holds no tensor: the assignment comes from the shapes (on the meta
        # device), and each shard's first values are made on its node, from the run's seed.
        shapes, _, _ = build_blocks_for_shapes(cfg.model)
        sizes = {f"blocks.{i}.{n}": p.numel() for i, b in enumerate(shapes) for n, p in b.named_parameters()}
        del shapes
        self.assignment = assign_shards(sizes, cfg.comm.ps_shards)
        cls = remote_shard_class()
        self.timeout_s = cfg.comm.timeout_s
        here = NodeAffinitySchedulingStrategy(node_id, soft=False)
        model_json = cfg.model.model_dump(mode="json")
        self.handles = []
        for i in range(cfg.comm.ps_shards):
            names = sorted(n for n, s in self.assignment.items() if s == i)
            init = _initial_params.options(scheduling_strategy=here).remote(model_json, cfg.train.seed, names)
            self.handles.append(cls.options(name=f"{run_name}-ps{i}", namespace=NAMESPACE, scheduling_strategy=here)
                                .remote(init, cfg.train.model_dump(mode="json"), dp, shard_index=i,
                                        timeout_s=cfg.comm.timeout_s, torch_threads=1))
        self.snaps: dict[int, list] = {}

    def snapshot(self, step: int) -> None:
        """Take the shards' state after ``step`` (the controller owns the refs)."""
        self.snaps[step] = [h.export_state.remote(step) for h in self.handles]

    def retain(self, steps) -> None:
        """Keep the shards' snapshots of ``steps`` only: those the workers' snapshot store keeps."""
        keep = set(steps)
        for old in [s for s in self.snaps if s not in keep]:
            del self.snaps[old]

    def shards(self, step: int) -> list | None:
        """Refs of the shards' state at ``step`` (layout-free shards covering every block)."""
        return self.snaps.get(step)

    def restorable_steps(self) -> set[int]:
        """Steps the shards can be put back at: those of their kept snapshots, and the step
        every shard is at now (where they all agree), which needs no load."""
        versions = set(ray.get([h.version.remote() for h in self.handles], timeout=self.timeout_s))
        return set(self.snaps) | (versions if len(versions) == 1 else set())

    def restore(self, step: int, dp: int, sources: list | None = None) -> None:
        """Put every shard at ``step`` for ``dp`` replicas: drop half-pushed steps, and load
        ``sources`` (else the snapshot of ``step``) where a shard is elsewhere."""
        versions = ray.get([h.version.remote() for h in self.handles], timeout=self.timeout_s)
        calls = []
        for i, (h, v) in enumerate(zip(self.handles, versions)):
            if v != step:
                if sources:
                    state = list(sources)   # layout-free parts: each shard keeps its names of each
                elif step in self.snaps:
                    state = [self.snaps[step][i]]   # the shard's own snapshot, nobody else's
                else:
                    raise RuntimeError(f"parameter server is at step {v}, the workers restore step {step}, "
                                       f"and no snapshot of the shards at step {step} is kept "
                                       f"(kept: {sorted(self.snaps)})")
                # Refs nested in a list go through unresolved: the shard reads them itself, so no
                # state passes through this process.
                calls.append(h.load_state.remote(state))
            calls.append(h.reset_pending.remote(dp))
        ray.get(calls, timeout=self.timeout_s)

    def abandon_step(self) -> None:
        """A step failed: drop its pushes so workers waiting on a pull stop waiting."""
        try:
            ray.get([h.reset_pending.remote() for h in self.handles], timeout=self.timeout_s)
        except Exception:  # noqa: BLE001 - restore() tries again, and reports what is wrong
            pass

    def kill(self) -> None:
        for h in self.handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
