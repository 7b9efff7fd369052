"""The pieces of what a run keeps: the resume check, the weights file, storage retries, and the
one line on what a placement survives."""

import pytest
import torch

from elastic_trainer.checkpoint.compat import resume_differences
from elastic_trainer.storage.retry import StorageError, with_retries
from elastic_trainer.checkpoint.weights import WeightsError, load_weights, save_weights, weights_from_shards
from elastic_trainer.checkpoint.dtypes import to_numpy
from elastic_trainer.controller.run.placement import fault_tolerance
from elastic_trainer.parallel.topology import Topology


def cfg(d_model=32, dp=2, path="/d", seed=1):
    return {"model": {"kind": "gpt", "d_model": d_model, "n_layer": 2}, "data": {"path": path, "seq_len": 16,
            "column": "tokens", "shuffle": True}, "train": {"seed": seed, "global_batch_size": 8, "lr": 1e-3},
            "parallel": {"dp": dp, "pp": 1}}


def test_resume_differences_name_model_and_data_fields_but_not_the_layout():
    assert resume_differences(cfg(), cfg(dp=4), {"rows": 10}, {"rows": 10}) == []
    assert resume_differences(cfg(), cfg(d_model=64), None, None) == ["model.d_model: checkpoint 32, this run 64"]
    diff = resume_differences(cfg(), cfg(path="/e", seed=2), {"rows": 10, "schema": "a"}, {"rows": 9, "schema": "a"})
    assert diff == ["data (rows): checkpoint 10, this run 9", "data.path: checkpoint '/d', this run '/e'",
                    "train.seed: checkpoint 1, this run 2"]


def test_weights_round_trip_bit_for_bit_and_a_folder_in_the_way_is_a_weights_error(tmp_path):
    state = {"blocks.0.w": torch.randn(3, 4), "blocks.1.b": torch.randn(5).to(torch.bfloat16)}
    path = save_weights(str(tmp_path / "out"), state, {"step": 7})
    back = load_weights(path)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    (tmp_path / "file").write_text("x")
    with pytest.raises(WeightsError, match="not saved to .*file/out"):
        save_weights(str(tmp_path / "file" / "out"), state, {}, retries=0)


def test_weights_from_snapshot_shards_by_global_name():
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    shards = [{"params": {"blocks.0.w": to_numpy(w)}}, {"params": {"blocks.1.w": to_numpy(w + 1)}}]
    out = weights_from_shards(shards)
    assert torch.equal(out["blocks.0.w"], w) and torch.equal(out["blocks.1.w"], w + 1)


def test_storage_retries_back_off_then_name_what_failed():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError("AWS Error SLOW_DOWN")
        return "ok"

    assert with_retries(flaky, "writing x", retries=2, backoff_s=0.001) == "ok" and len(calls) == 3
    with pytest.raises(StorageError, match=r"writing y failed after 2 attempts: OSError: down"):
        with_retries(lambda: (_ for _ in ()).throw(OSError("down")), "writing y", retries=1, backoff_s=0.001)
    with pytest.raises(FileNotFoundError):   # not transient: not retried, not wrapped
        with_retries(lambda: (_ for _ in ()).throw(FileNotFoundError("gone")), "reading z", retries=5)


def test_the_fault_tolerance_line_says_which_losses_a_placement_survives():
    topo = Topology(2, 2)
    one = fault_tolerance(topo, {r: "A" for r in range(4)}, 2)
    assert one.startswith("4 workers on 1 node: losing that node loses every copy")
    spread = fault_tolerance(topo, {0: "A", 1: "A", 2: "B", 3: "B"}, 2)
    assert spread.endswith("every stage has replicas on 2 or more nodes, so losing any 1 node is survived from live replicas")
    pp_only = fault_tolerance(Topology(1, 2), {0: "A", 1: "B"}, 2)
    assert "stages 0, 1 sit on one node each" in pp_only and "last snapshot (copies on 2 nodes)" in pp_only
