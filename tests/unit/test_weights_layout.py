"""The weights as Hugging Face's sharded layout: parts written and read back by their writers, the
index last; the package's loader reads the folder, one file, or a part at a time."""

import json

import pytest
import torch

from elastic_trainer.checkpoint.durable import CheckpointError, DurableStore, read_parts
from elastic_trainer.checkpoint.weights import (INDEX, WeightsError, iter_weights, load_weights, part_file,
                                                read_metadata, save_weights, write_index, write_safetensors)


def test_parts_and_index_make_a_folder_the_loader_reads(tmp_path):
    where = str(tmp_path / "out")
    a = {"blocks.0.w": torch.arange(6.0).reshape(2, 3)}
    b = {"blocks.1.w": torch.ones(4), "blocks.2.w": torch.zeros(1)}
    parts = [write_safetensors(where, part_file(0, 2), a, {"step": 3}),
             write_safetensors(where, part_file(1, 2), b, {"step": 3})]
    assert [p["file"] for p in parts] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert parts[1]["names"] == ["blocks.1.w", "blocks.2.w"] and parts[0]["bytes"] > 24
    path = write_index(where, parts, {"step": 3, "model": {"kind": "gpt"}})
    assert path == where
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    assert index["weight_map"] == {"blocks.0.w": parts[0]["file"], "blocks.1.w": parts[1]["file"],
                                   "blocks.2.w": parts[1]["file"]}
    assert index["metadata"]["total_size"] == parts[0]["bytes"] + parts[1]["bytes"]
    assert index["metadata"]["files"][parts[0]["file"]]["sha256"] == parts[0]["sha256"]
    got = load_weights(where)
    assert set(got) == {"blocks.0.w", "blocks.1.w", "blocks.2.w"} and torch.equal(got["blocks.0.w"], a["blocks.0.w"])
    assert read_metadata(where) == {"step": 3, "model": {"kind": "gpt"}}
    assert [sorted(p) for p in iter_weights(where)] == [["blocks.0.w"], ["blocks.1.w", "blocks.2.w"]]


def test_a_single_file_and_its_folder_read_the_same(tmp_path):
    path = save_weights(str(tmp_path), {"blocks.0.w": torch.ones(2)}, {"step": 1})
    assert path.endswith("model.safetensors")
    assert load_weights(path).keys() == load_weights(str(tmp_path)).keys() == {"blocks.0.w"}
    assert read_metadata(str(tmp_path)) == {"step": 1}
    with pytest.raises(WeightsError, match="does not exist"):
        load_weights(str(tmp_path / "nothing-here"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="holds neither model.safetensors.index.json nor model.safetensors"):
        load_weights(str(tmp_path / "empty"))


def test_a_part_that_cannot_be_written_is_an_error_naming_it(tmp_path):
    (tmp_path / "file").write_text("in the way")
    with pytest.raises(WeightsError, match=r"model-00001-of-00001.safetensors was not saved to .*file/out"):
        write_safetensors(str(tmp_path / "file" / "out"), part_file(0, 1), {"w": torch.ones(1)}, {})


def _shard(step, blocks, value):
    import numpy as np

    return {"step": step, "blocks": blocks, "extra": {},
            "params": {f"blocks.{b}.w": np.full((2,), value, np.float32) for b in blocks},
            "optim": {f"blocks.{b}.w": {"exp_avg": np.zeros((2,), np.float32)} for b in blocks}}


def test_durable_parts_are_written_one_by_one_and_committed_by_the_manifest(tmp_path):
    store = DurableStore(str(tmp_path), run_id="r1")
    files = [store.write_part(5, i, _shard(5, [i], float(i))) for i in range(2)]
    assert [f["name"] for f in files] == ["shard-000.pt", "shard-001.pt"] and all(f["seconds"] >= 0 for f in files)
    with pytest.raises(CheckpointError, match="has no manifest.json: it was not finished"):
        store.load_latest()   # no manifest yet: half-written, not a checkpoint
    store.commit(5, files, {"run_name": "x"})
    seen = []

    def reader(st, name, manifest):   # another process's reads, as a run's are
        seen.append(name)
        return read_parts(st, name, manifest)

    shards, manifest, problems = store.load_latest(reader=reader)
    assert seen == ["step-00000005-r1"] and problems == [] and manifest["run_name"] == "x"
    assert [s["blocks"] for s in shards] == [[0], [1]] and shards[1]["params"]["blocks.1.w"][0] == 1.0
    assert "seconds" not in manifest["files"][0]


def test_parts_written_on_other_machines_are_found_missing_before_the_index_or_manifest(tmp_path):
    from elastic_trainer.checkpoint.weights import unseen_parts

    # A part whose writer's local path is not this machine's: it is not here, or not whole.
    here = write_safetensors(str(tmp_path / "out"), part_file(0, 2), {"a": torch.ones(2)}, {})
    elsewhere = dict(here, file=part_file(1, 2), names=["b"])
    assert unseen_parts(str(tmp_path / "out"), [here, elsewhere]) == [elsewhere]
    store = DurableStore(str(tmp_path / "ck"), run_id="r1")
    written = store.write_part(3, 0, _shard(3, [0], 1.0))
    ghost = dict(written, name="shard-001.pt", node="n2")
    with pytest.raises(CheckpointError, match=r"not one storage for every node: shard-001.pt \(written on node n2\)"):
        store.commit(3, [written, ghost], {})
    assert not (tmp_path / "ck" / "step-00000003-r1" / "manifest.json").exists()


def test_a_stage_whose_hf_part_fails_still_writes_its_weights_and_says_so(tmp_path):
    from elastic_trainer.worker.weights_writer import write_stage

    (tmp_path / "file").write_text("in the way")
    job = {"where": str(tmp_path / "out"), "file": part_file(0, 1), "meta": {"step": 1}, "retries": 0, "run": "r",
           "hf": {"where": str(tmp_path / "file" / "hf"), "file": part_file(0, 1), "names": {"blocks.0.w": "w"}}}
    got = write_stage({"blocks.0.w": torch.ones(2)}, job, "n1")
    assert "error" not in got and got["part"]["file"] == part_file(0, 1) and got["hf"] is None
    assert "was not saved" in got["hf_error"] and got["node"] == "n1"
