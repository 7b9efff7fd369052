"""Parameter-server mode keeps no tensor in the controller: the shards' assignment comes from the
model's shapes, each shard's first values are made on its node, and a restore hands each shard
refs to read itself (before, the controller built the whole model, and a restore pulled every
shard's weights and AdamW state into it and sent each shard all of them)."""

from types import SimpleNamespace

from elastic_trainer import TrainerConfig
from elastic_trainer.controller.run import ps_group
from elastic_trainer.models.factory import block_param_counts

from ..conftest import tiny_config


class _Remote:
    def __init__(self, log, what):
        self.log, self.what = log, what

    def options(self, **kw):
        return self

    def remote(self, *args, **kw):
        self.log.append((self.what, args, kw))
        return f"ref:{self.what}:{len(self.log)}"


class _Handle:
    def __init__(self, version):
        self.calls, self._version = [], version

    def __getattr__(self, method):
        return SimpleNamespace(remote=lambda *a: self.calls.append((method, a)) or (method, self._version))


def test_no_weights_in_the_controller_at_the_start_or_a_restore(monkeypatch):
    cfg = TrainerConfig.from_dict(tiny_config("/nonexistent", comm={"sync": "parameter_server", "ps_shards": 2}))
    log = []

    def whole(*a, **k):
        raise AssertionError("the controller built the model")

    monkeypatch.setattr(ps_group, "build_own_blocks", whole, raising=False)
    monkeypatch.setattr(ps_group, "build_model", whole, raising=False)
    monkeypatch.setattr(ps_group, "_initial_params", _Remote(log, "init"))
    monkeypatch.setattr(ps_group, "remote_shard_class", lambda: _Remote(log, "shard"))
    monkeypatch.setattr(ps_group, "NodeAffinitySchedulingStrategy", lambda *a, **k: None)
    servers = ps_group.ParameterServers(cfg, "ps", "node0", dp=2)
    inits = [args for what, args, _ in log if what == "init"]
    names = [n for _, _, ns in inits for n in ns]
    assert len(inits) == 2 and sorted(names) == sorted(servers.assignment) and len(set(names)) == len(names)
    # Every shard is made from a ref to its own first values, never from values passed here.
    assert all(isinstance(args[0], str) and args[0].startswith("ref:init") for what, args, _ in log if what == "shard")
    assert len(servers.assignment) > len(block_param_counts(cfg.model))   # names, not blocks

    # A restore: shard 0 is at step 5, shard 1 at step 4; the snapshot of step 5 is kept.
    servers.handles = [_Handle(5), _Handle(4)]
    monkeypatch.setattr(ps_group.ray, "get", lambda refs, timeout=None: [r[1] for r in refs]
                        if all(isinstance(r, tuple) for r in refs) else refs)
    servers.snaps[5] = ["snap5-shard0", "snap5-shard1"]
    servers.restore(5, dp=1)
    assert ("load_state", (["snap5-shard1"],)) in servers.handles[1].calls
    assert not [c for c in servers.handles[0].calls if c[0] == "load_state"]
