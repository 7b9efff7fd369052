"""A run's durable checkpoint out as a torch distributed checkpoint, and a run started from it.

dp=2 x pp=2 with durable storage; ``export --format dcp`` of its final checkpoint; a fresh Python
process (no Ray, no process group) loads it with ``torch.distributed.checkpoint.load`` into the
single-process model's state dict and AdamW's flattened one: the run's final weights and its
checkpoint's optimizer state, bit for bit. Then a 1 x 4 run ``model.init_from`` that folder, one
step at lr 1e-30 (an update far below every weight's last bit): its weights are the source's,
bit for bit, so every rank read its own blocks from the export."""

import json
import os
import subprocess
import sys

import pytest
import torch

from elastic_trainer import Trainer
from elastic_trainer.checkpoint.durable import DurableStore
from elastic_trainer.checkpoint.state import merge_shards
from elastic_trainer.cli.commands import main
from elastic_trainer.storage.uris import split_last

from .test_recovery import config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Run as its own process: the single-process model's state dict and AdamW's, flattened as
# torch's get_optimizer_state_dict(flatten_optimizer_state_dict=True) gives it, under "optimizer".
LOAD = r"""
import json, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch import nn
from elastic_trainer.config import TrainerConfig
from elastic_trainer.models import build_model

folder, cfg_path, out = sys.argv[1:]
with open(cfg_path) as f:
    cfg = TrainerConfig.model_validate(json.load(f))
model = nn.Module()
model.blocks = nn.ModuleList(build_model(cfg)[0])
state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
state["optimizer"] = {f"state.{n}.{k}": torch.zeros_like(p) for n, p in model.named_parameters()
                      for k in ("exp_avg", "exp_avg_sq")}
state["optimizer"].update({f"state.{n}.step": torch.tensor(0.0) for n, _ in model.named_parameters()})
dcp.load(state, checkpoint_id=folder)
assert not dist.is_initialized()
torch.save(state, out)
"""


def test_export_dcp_loads_in_a_plain_process_and_a_run_starts_from_it(cluster, corpus_dir, tmp_path):
    cfg = config(corpus_dir, "dcp-src", steps=3, parallel={"dp": 2, "pp": 2},
                 checkpoint={"storage": str(tmp_path / "ck")})
    src = Trainer(cfg, verbose=False).fit(return_model_state=True)
    out = str(tmp_path / "dcp")
    assert main(["export", "--format", "dcp", src.durable_path, out]) == 0
    parent, name = split_last(src.durable_path)
    store = DurableStore(parent)
    manifest = store.read_manifest(name)
    assert sorted(f for f in os.listdir(out) if f.endswith(".distcp")) == [
        f"__{k}_0.distcp" for k in range(len(manifest["files"]))]

    (tmp_path / "cfg.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    subprocess.run([sys.executable, "-c", LOAD, out, str(tmp_path / "cfg.json"), str(tmp_path / "loaded.pt")],
                   check=True, env=env, timeout=120)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    optim = loaded.pop("optimizer")
    assert loaded.keys() == src.model_state.keys()
    for k, v in src.model_state.items():
        assert torch.equal(loaded[k], v), k
    _, _, moments = merge_shards(store.load_dir(name)[0], list(src.model_state))
    assert moments.keys() == src.model_state.keys()
    for n, st in moments.items():
        for k, v in st.items():
            assert torch.equal(optim[f"state.{n}.{k}"], torch.as_tensor(v).reshape(optim[f"state.{n}.{k}"].shape)), (n, k)

    tuned = config(corpus_dir, "dcp-init", steps=1, parallel={"dp": 1, "pp": 4},
                   model={"init_from": out}, train={"lr": 1e-30})
    started = Trainer(tuned, verbose=False).fit(return_model_state=True)
    for k, v in src.model_state.items():
        assert torch.equal(started.model_state[k], v), k
