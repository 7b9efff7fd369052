import dataclasses

import pytest
import torch
from torch import nn

from elastic_trainer.config import ModelSection
from elastic_trainer.errors import ModelError
from elastic_trainer.models.factory import block_param_counts, build_blocks


def test_gpt_blocks_compose_to_a_language_model():
    cfg = ModelSection(n_layer=2, n_head=2, d_model=16, seq_len=8)
    blocks, loss_fn = build_blocks(cfg, seed=0)
    assert len(blocks) == 4
    x = torch.randint(0, 256, (3, 8))
    logits = nn.Sequential(*blocks)(x)
    assert logits.shape == (3, 8, 256)
    loss = loss_fn(logits, x)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.2  # near-uniform at init


def test_same_seed_same_weights_and_meta_counts_match():
    cfg = ModelSection(n_layer=2, n_head=2, d_model=16, seq_len=8)
    a, _ = build_blocks(cfg, seed=5)
    b, _ = build_blocks(cfg, seed=5)
    for x, y in zip(a, b):
        for p, q in zip(x.parameters(), y.parameters()):
            assert torch.equal(p, q)
    assert block_param_counts(cfg) == [sum(p.numel() for p in blk.parameters()) for blk in a]


def test_user_factory():
    cfg = ModelSection(factory="tests.helpers:build_mlp", kwargs={"width": 8, "depth": 2})
    assert cfg.kind == "factory"
    blocks, _ = build_blocks(cfg, seed=0)
    assert len(blocks) == 4


@pytest.mark.parametrize("factory, match", [
    ("no_such_pkg.models:build", "cannot import 'no_such_pkg.models'"),
    ("tests.helpers:missing", "has no callable 'missing'"),
    ("tests.helpers:not_a_pair", "must return \\(blocks, loss_fn\\)"),
])
def test_factory_errors(factory, match):
    with pytest.raises(ModelError, match=match):
        build_blocks(ModelSection(factory=factory), seed=0)


def test_a_factory_module_that_reads_a_tensor_at_import_is_sized_and_built(monkeypatch):
    import sys

    from elastic_trainer.planning.model_shape import model_shape
    from elastic_trainer.worker.block_build import build_rank_blocks
    from tests.conftest import tiny_config
    from elastic_trainer.config import TrainerConfig

    monkeypatch.delitem(sys.modules, "tests.factory_import_tensor", raising=False)
    model = ModelSection(factory="tests.factory_import_tensor:build", kwargs={"width": 8})
    real, _ = build_blocks(model, seed=0)
    monkeypatch.delitem(sys.modules, "tests.factory_import_tensor")
    # Sizing imports the module first (here, for the first time), outside the meta device.
    assert block_param_counts(model) == [sum(p.numel() for p in b.parameters()) for b in real]
    cfg = TrainerConfig.from_dict(tiny_config("/tmp/unused", model=model.model_dump()))
    shape = model_shape(cfg)
    assert shape.why and "meta" in shape.why  # sized from a real build: shapes, no activations
    # A restore falls back to a real build of the blocks it gains.
    blocks, _, info = build_rank_blocks(model, 0, [1, 2], torch.device("cpu"), restoring=True)
    assert info["init"] == "whole" and sorted(blocks) == [1, 2]


def test_counting_parameters_on_meta_imports_no_dynamo():
    # The controller counts parameters before it places a worker: a random initialiser on the
    # meta device ran torch's reference kernels, whose first call imported torch._dynamo (1.2 s).
    import subprocess
    import sys

    code = ("import sys\n"
            "from elastic_trainer.config import ModelSection\n"
            "from elastic_trainer.models.factory import block_param_counts\n"
            "counts = block_param_counts(ModelSection(n_layer=2, n_head=2, d_model=16, seq_len=8))\n"
            "print(counts, 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    real, _ = build_blocks(ModelSection(n_layer=2, n_head=2, d_model=16, seq_len=8), seed=0)
    assert out.strip() == f"{[sum(p.numel() for p in b.parameters()) for b in real]} False"


def test_the_drivers_measured_shape_is_the_controllers():
    # The driver measures the built-in models' shape and hands it over; the controller, which
    # reads the config back from JSON, finds it under the same key and measures nothing.
    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.planning.model_shape import ShapeInBackground, model_shape, remember_shape
    from tests.conftest import tiny_config

    cfg = TrainerConfig.from_dict(tiny_config("/tmp/unused", model={"n_layer": 3}))
    shape = ShapeInBackground(cfg).result()
    assert shape is not None and shape == model_shape(cfg) and len(shape.param_shapes) == 5
    again = TrainerConfig.model_validate(cfg.model_dump(mode="json"))
    handed = dataclasses.replace(shape, note="handed over")
    remember_shape(cfg, handed)
    assert model_shape(again) is handed
    # A user's factory is measured by the controller (a build that fails on meta is a real one).
    user = TrainerConfig.from_dict(tiny_config("/tmp/unused", model={"factory": "tests.helpers:build_mlp"}))
    assert ShapeInBackground(user).result() is None
    # So are weights to load: built for real where the meta device will not do.
    loaded = cfg.model_copy(update={"model": ModelSection(kind="hf", init_from="/nowhere/llama")})
    assert ShapeInBackground(loaded).result() is None
    with pytest.raises(TypeError, match="ModelShape is needed, not dict"):
        remember_shape(cfg, {})
