"""The Ray cluster a Trainer starts for itself listens on loopback, as its comment promises, even where
Ray would put 127.0.0.1 on the machine's routable address (Linux without
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0); nothing is started here: ``ray.init`` is replaced by a recorder."""

import ray
from ray._private import ray_constants, services

from elastic_trainer import Trainer, TrainerConfig
from elastic_trainer import trainer as trainer_module

from ..conftest import tiny_config


def test_a_local_cluster_is_started_on_loopback(monkeypatch, tmp_path):
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    # A routable address of this machine, as Ray would find one (a documentation range: none is used).
    monkeypatch.setattr(services, "node_ip_address_from_perspective", lambda address=None: "198.18.0.1")
    assert services.resolve_ip_for_localhost("127.0.0.1") == "198.18.0.1"   # what Ray does unkept
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(trainer_module, "_started_cluster", lambda: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    seen = []
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append(services.resolve_ip_for_localhost(kw["_node_ip_address"])))
    cfg = TrainerConfig.from_dict(tiny_config(str(tmp_path)))
    assert Trainer(cfg, verbose=False)._connect(cfg) is True
    assert seen == ["127.0.0.1"]
    assert ray_constants.ENABLE_RAY_CLUSTER is True   # put back after
