"""Hugging Face causal LMs cut into blocks: the blocks' logits are the model's, ties are declared,
names map back, and the export folder loads with from_pretrained."""

import pytest
import torch
import transformers

from elastic_trainer.config import ModelSection
from elastic_trainer.errors import ConfigError, ModelError
from elastic_trainer.config import TrainerConfig
from elastic_trainer.checkpoint.hf_export import ExportError, hf_state, write_hf_folder
from elastic_trainer.models.factory import build_blocks, build_blocks_for_shapes
from elastic_trainer.models.hf import block_ties, build_hf_blocks, hf_name_map
from elastic_trainer.parallel.topology import Topology
from elastic_trainer.worker.ties import TiedGrads


LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
GPT2 = dict(model_type="gpt2", vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def full_model(hf, seed=0):
    hf = dict(hf)
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")


@pytest.mark.parametrize("hf", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_blocks_reproduce_the_models_logits(hf):
    torch.manual_seed(0)
    blocks, loss_fn = build_hf_blocks(hf)
    assert len(blocks) == 2 + 2  # embeddings, two layers, norm + head
    x = torch.randint(0, 64, (2, 12))
    h = x
    for b in blocks:
        h = b(h)
    torch.testing.assert_close(h, full_model(hf)(input_ids=x).logits, rtol=0, atol=1e-6)


def test_causal_attention_future_tokens_do_not_leak():
    torch.manual_seed(0)
    blocks, _ = build_hf_blocks(LLAMA)
    x = torch.randint(0, 64, (1, 10))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 64

    def run(ids):
        h = ids
        for b in blocks:
            h = b(h)
        return h

    torch.testing.assert_close(run(x)[:, :-1], run(y)[:, :-1])


def test_tied_embeddings_become_a_declared_pair():
    torch.manual_seed(0)
    blocks, _ = build_hf_blocks(GPT2)
    assert block_ties(blocks) == [("blocks.0.embed_tokens.weight", "blocks.3.lm_head.weight")]
    head, embed = blocks[-1].lm_head.weight, blocks[0].embed_tokens.weight
    assert head is not embed and torch.equal(head, embed)
    names = hf_name_map(blocks)
    assert names["blocks.0.embed_tokens.weight"] == "transformer.wte.weight"
    assert "blocks.3.lm_head.weight" not in names  # written once, tied again on load
    torch.manual_seed(0)
    assert block_ties(build_hf_blocks(LLAMA)[0]) == []  # Llama's default: untied


def test_tied_grads_sum_on_one_rank():
    torch.manual_seed(0)
    blocks, _ = build_hf_blocks(GPT2)
    named = {f"blocks.{i}.{n}": p for i, b in enumerate(blocks) for n, p in b.named_parameters()}
    a, b = named["blocks.0.embed_tokens.weight"], named["blocks.3.lm_head.weight"]
    a.grad, b.grad = torch.ones_like(a), torch.full_like(b, 2.0)
    ties = TiedGrads(block_ties(blocks), named, [(0, 4)], Topology(1, 1), 0, None)
    ties.sync(None)
    assert torch.equal(a.grad, torch.full_like(a, 3.0)) and torch.equal(b.grad, a.grad)
    assert ties.followers == {"blocks.3.lm_head.weight"}


def test_builds_on_meta_and_through_the_factory():
    model = ModelSection(kind="hf", hf_config=LLAMA)
    blocks, _, on_meta = build_blocks_for_shapes(model)
    assert on_meta and all(p.device.type == "meta" for b in blocks for p in b.parameters())
    assert not any(True for b in blocks for _ in b.buffers())  # rotary tables are made on first use
    real, _ = build_blocks(model, seed=5)
    torch.manual_seed(5)
    ref = full_model(LLAMA, seed=5)
    torch.testing.assert_close(real[0].embed_tokens.weight, ref.model.embed_tokens.weight)


def test_export_folder_loads_with_from_pretrained(tmp_path):
    model = ModelSection(kind="hf", hf_config=GPT2)
    blocks, _ = build_blocks(model, seed=1)
    state = {f"blocks.{i}.{n}": p.detach() for i, b in enumerate(blocks) for n, p in b.named_parameters()}
    out = write_hf_folder(state, model, str(tmp_path / "hf"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    x = torch.randint(0, 64, (2, 8))
    h = x
    for b in blocks:
        h = b(h)
    torch.testing.assert_close(loaded(input_ids=x).logits, h, rtol=1e-5, atol=1e-5)
    with pytest.raises(ExportError, match="lack 1 of the model's parameters"):
        hf_state({k: v for k, v in state.items() if k != "blocks.0.wpe.weight"}, model)


def test_config_errors_name_what_is_missing(tmp_path):
    base = {"data": {"path": "x"}}
    with pytest.raises(ConfigError, match="needs model.hf_config"):
        TrainerConfig.from_dict({**base, "model": {"kind": "hf"}})
    with pytest.raises(ConfigError, match="needs a model_type"):
        TrainerConfig.from_dict({**base, "model": {"kind": "hf", "hf_config": {"hidden_size": 8}}})
    with pytest.raises(ConfigError, match="need model.kind 'hf'"):
        TrainerConfig.from_dict({**base, "model": {"hf_config": LLAMA}})
    with pytest.raises(ModelError, match="no config.json there"):
        build_hf_blocks(str(tmp_path / "nowhere"))
    with pytest.raises(ModelError, match="is not a transformers model"):
        build_hf_blocks({"model_type": "no-such-model"})
    with pytest.raises(ModelError, match="sliding-window"):
        build_hf_blocks({"model_type": "mistral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "sliding_window": 16})


def test_init_from_a_save_pretrained_folder(tmp_path):
    ref = full_model(LLAMA, seed=9)
    ref.save_pretrained(tmp_path / "pre")
    blocks, _ = build_hf_blocks(init_from=str(tmp_path / "pre"))
    torch.testing.assert_close(blocks[1].layer.self_attn.q_proj.weight, ref.model.layers[0].self_attn.q_proj.weight)
    blocks2, _ = build_hf_blocks(hf_config=str(tmp_path / "pre" / "config.json"))
    assert blocks2[1].layer.self_attn.q_proj.weight.shape == ref.model.layers[0].self_attn.q_proj.weight.shape


def test_export_sources_that_cannot_be_exported_say_why(tmp_path, capsys):
    from elastic_trainer.checkpoint.weights import save_weights
    from elastic_trainer.cli.commands import main

    assert main(["export", str(tmp_path / "none"), "--hf", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    gpt = ModelSection(kind="gpt", n_layer=1, n_head=1, d_model=8)
    save_weights(str(tmp_path / "run"), {"blocks.0.tok.weight": torch.zeros(2, 2)},
                 {"model": gpt.model_dump(mode="json"), "step": 1})
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "o")]) == 2
    assert "--hf needs a run of model.kind 'hf'; this one is 'gpt'" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), "--hf", str(tmp_path / "o")]) == 2
    assert "holds neither model.safetensors" in capsys.readouterr().err


def test_export_from_a_durable_checkpoint(tmp_path):
    import numpy as np

    from elastic_trainer.checkpoint.durable import DurableStore
    from elastic_trainer.checkpoint.hf_export import export

    model = ModelSection(kind="hf", hf_config=LLAMA)
    blocks, _ = build_blocks(model, seed=2)
    shards = [{"step": 3, "blocks": [i], "extra": {}, "optim": {},
               "params": {f"blocks.{i}.{n}": p.detach().numpy().copy() for n, p in b.named_parameters()}}
              for i, b in enumerate(blocks)]
    store = DurableStore(str(tmp_path / "ck"), run_id="abc123")
    path = store.save(3, shards, {"config": {"model": model.model_dump(mode="json")}})
    out = export(path, str(tmp_path / "hf"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    np.testing.assert_array_equal(loaded.model.layers[1].mlp.up_proj.weight.detach().numpy(),
                                  blocks[2].layer.mlp.up_proj.weight.detach().numpy())
