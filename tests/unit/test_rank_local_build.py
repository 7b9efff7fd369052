"""A rank builds (or reads) its own blocks and nothing else, and every layout starts from one model.

The initial weights at 1x1, 2x2, 1x4, 4x1 and interleaved stages are the
public single-process build's, bit for bit, for the GPT and for Hugging Face
Llama and GPT-2 (tied); ``init_from`` a sharded folder reads each rank's
tensors from the files that hold them and no others.
"""

import json
import os

import pytest
import torch
import transformers

from elastic_trainer.config import ModelSection
from elastic_trainer.errors import ModelError
from elastic_trainer.models import build_model
from elastic_trainer.models.build import build_own_blocks
from elastic_trainer.models.factory import block_param_counts
from elastic_trainer.parallel.partition import blocks_for_rank, partition_blocks
from elastic_trainer.worker.block_build import build_rank_blocks

CPU = torch.device("cpu")
GPT = ModelSection(n_layer=4, n_head=2, d_model=16, seq_len=8)
LLAMA = ModelSection(kind="hf", hf_config=dict(
    model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
GPT2 = ModelSection(kind="hf", hf_config=dict(
    model_type="gpt2", vocab_size=64, n_embd=32, n_layer=4, n_head=4, n_positions=32))
# (dp, pp, stages per rank): dp only repeats a replica's blocks, so one replica is built.
LAYOUTS = [(1, 1, 1), (2, 2, 1), (1, 4, 1), (4, 1, 1), (1, 2, 2), (1, 3, 2)]


def state_of(blocks: dict) -> dict[str, torch.Tensor]:
    return {f"blocks.{i}.{n}": p.detach() for i, b in blocks.items() for n, p in b.named_parameters()}


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() <= want.keys()
    for k, v in got.items():
        assert torch.equal(v, want[k]), k


@pytest.mark.parametrize("model", [GPT, LLAMA, GPT2], ids=["gpt", "llama", "gpt2-tied"])
def test_every_layout_starts_from_the_public_single_process_build(model):
    whole, _ = build_model(model, 7)
    want = state_of(dict(enumerate(whole)))
    counts = block_param_counts(model)
    for dp, pp, virtual in LAYOUTS:
        bounds = partition_blocks(counts, pp * virtual)
        seen = {}
        for pp_rank in range(pp):
            own = blocks_for_rank(bounds, pp_rank, pp, virtual)
            blocks, _, info = build_rank_blocks(model, 7, own, CPU, restoring=False)
            assert sorted(blocks) == own and info["init"] == "seed", (dp, pp, virtual)
            got = state_of(blocks)
            assert_same(got, want)
            seen.update(got)
        assert seen.keys() == want.keys()


def test_another_seed_another_model_and_the_callers_random_state_is_left_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = state_of(dict(enumerate(build_model(GPT, 1)[0])))
    assert torch.equal(torch.get_rng_state(), before)
    b = state_of(dict(enumerate(build_model(GPT, 2)[0])))
    assert not torch.equal(a["blocks.1.qkv.weight"], b["blocks.1.qkv.weight"])
    # GPT-2's init: biases zero, norms one, residual projections scaled by depth.
    assert torch.equal(a["blocks.1.qkv.bias"], torch.zeros(48)) and torch.equal(a["blocks.1.ln1.weight"], torch.ones(16))
    assert a["blocks.1.proj.weight"].std() < a["blocks.1.qkv.weight"].std()


def test_a_tied_head_starts_equal_to_its_embedding_on_its_own_rank():
    blocks, _, ties, _ = build_own_blocks(GPT2, 3, [5])
    assert ties == [("blocks.0.embed_tokens.weight", "blocks.5.lm_head.weight")] and list(blocks) == [5]
    whole, _ = build_model(GPT2, 3)
    assert torch.equal(blocks[5].lm_head.weight, whole[0].embed_tokens.weight)


def test_a_seeded_hf_model_loads_into_transformers_and_gives_the_blocks_logits():
    from elastic_trainer.checkpoint.hf_export import hf_state

    blocks, _ = build_model(LLAMA, 4)
    weights, config = hf_state(state_of(dict(enumerate(blocks))), LLAMA)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.load_state_dict(weights)
    x = torch.randint(0, 64, (2, 12))
    h = x
    for b in blocks:
        h = b(h)
    torch.testing.assert_close(h, model(input_ids=x).logits, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def sharded_folder(tmp_path_factory):
    """A Llama saved in many small shards (and its state by Hugging Face name)."""
    cfg = dict(LLAMA.hf_config)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("llama-sharded")
    model.save_pretrained(folder, max_shard_size="20KB")
    return str(folder), {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_init_from_a_sharded_folder_reads_only_each_ranks_shards(sharded_folder):
    folder, ref = sharded_folder
    weight_map = json.load(open(os.path.join(folder, "model.safetensors.index.json")))["weight_map"]
    assert len(set(weight_map.values())) > 4
    model = ModelSection(kind="hf", init_from=folder)
    bounds = partition_blocks(block_param_counts(model), 4)
    for pp_rank in range(4):
        own = blocks_for_rank(bounds, pp_rank, 4, 1)
        blocks, _, info = build_rank_blocks(model, 0, own, CPU, restoring=False)
        assert info["init"] == "load"
        hf_names = {f"blocks.{i}.{local}": hf for i, b in blocks.items()
                    for local, hf in b._et_hf_names.items()}
        for g, t in state_of(blocks).items():
            assert torch.equal(t, ref[hf_names[g]]), g
        assert info["files"] == sorted({weight_map[hf_names[g]] for g in hf_names}), pp_rank


def test_a_single_file_folder_and_a_bf16_one_are_read_and_cast(tmp_path):
    cfg = dict(GPT2.hf_config)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    blocks, _ = build_model(ModelSection(kind="hf", init_from=str(tmp_path)), 0)
    assert blocks[1].layer.attn.c_attn.weight.dtype == torch.float32
    assert torch.equal(blocks[1].layer.attn.c_attn.weight, model.transformer.h[0].attn.c_attn.weight.float())
    # GPT-2 saves its tied head once: the head block reads the embedding.
    assert torch.equal(blocks[-1].lm_head.weight, model.transformer.wte.weight.float())


def test_a_missing_or_misshaped_tensor_names_the_tensor_file_and_shapes(sharded_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = sharded_folder
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    name = "model.layers.2.mlp.up_proj.weight"
    file = index["weight_map"][name]
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in set(index["weight_map"].values()) | {"config.json", "model.safetensors.index.json"}:
        os.symlink(os.path.join(folder, f), broken / f)
    tensors = load_file(os.path.join(folder, file))
    tensors[name] = torch.zeros(3, 5)
    os.unlink(broken / file)
    save_file(tensors, str(broken / file), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=rf"{name}.*{file}.*\(3, 5\).*\(64, 32\)"):
        build_own_blocks(ModelSection(kind="hf", init_from=str(broken)), 0, [3])
    del tensors[name]
    save_file(tensors, str(broken / file), metadata={"format": "pt"})
    index["weight_map"].pop(name)
    (broken / "model.safetensors.index.json").unlink()
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match=rf"block 3's parameter 'layer.mlp.up_proj.weight'.*{name}"):
        build_own_blocks(ModelSection(kind="hf", init_from=str(broken)), 0, [3])
    # The blocks without it still load.
    assert build_own_blocks(ModelSection(kind="hf", init_from=str(broken)), 0, [1])[3]["how"] == "load"


def test_a_factory_that_opts_in_builds_only_the_blocks_asked_for():
    parts = ModelSection(factory="tests.helpers:build_mlp_parts", kwargs={"width": 8})
    blocks, _, _, info = build_own_blocks(parts, 5, [1, 2])
    assert info["how"] == "factory-part" and sorted(blocks) == [1, 2]
    whole, _ = build_model(parts, 5)
    assert_same(state_of(blocks), state_of(dict(enumerate(whole))))
    plain = ModelSection(factory="tests.helpers:build_mlp", kwargs={"width": 8})
    assert build_own_blocks(plain, 5, [1])[3]["how"] == "whole"
