"""Hugging Face models (a tiny Llama and a tiny GPT-2, built from configs) trained at dp x pp.

Losses, validation losses and learning rates match single-process ``transformers`` on the
same batches; a node loss mid-run continues the failure-free curve, and an evaluation a
failure interrupts is run again; ``export --hf`` writes a folder ``from_pretrained`` loads.
One cluster for the module (five one-CPU nodes: four ranks and a spare); the node-loss test
runs last because it removes a node.
"""

import json
import os
from urllib.parse import quote

import numpy as np
import pyarrow.fs as pafs
import pytest
import ray
import torch
import transformers
import torch.nn.functional as F

from elastic_trainer import Trainer, TrainerConfig
from elastic_trainer.cli.commands import main as cli_main
from elastic_trainer.checkpoint.hf_export import hf_state
from elastic_trainer.checkpoint.weights import load_weights
from elastic_trainer.data.splits import make_sampler
from elastic_trainer.data.splits import open_datasets
from elastic_trainer.lr_schedule import lr_at, set_lr
from elastic_trainer.models import build_model
from elastic_trainer.naming import NAMESPACE
from elastic_trainer.worker.faults import EVAL_FAULT_ENV, SNAPSHOT_DELAY_ENV
from elastic_trainer.worker.stage import build_optimizer

from ..conftest import tiny_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 8
LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
# GPT-2 ties its LM head to the token embeddings by default: the tie crosses stages at pp > 1.
GPT2 = dict(model_type="gpt2", vocab_size=256, n_embd=32, n_layer=4, n_head=4, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
FAST_FAILURE = {"startup_timeout_s": 60, "min_step_timeout_s": 3, "rendezvous_timeout_s": 10,
                "wait_for_nodes_s": 2, "allow_fault_injection": True}


def config(corpus, name, hf, dp, pp, **sections):
    return TrainerConfig.from_dict(tiny_config(
        corpus, run={"name": name}, model={"kind": "hf", "hf_config": hf},
        parallel={"dp": dp, "pp": pp, **sections.pop("parallel", {})},
        train={"steps": STEPS, "lr": 3e-3, "lr_schedule": "cosine", "warmup_steps": 2, "min_lr": 3e-4},
        eval={"fraction": 0.1, "every": 3, "batches": 2},
        failure=FAST_FAILURE, comm={"timeout_s": 20}, checkpoint={"memory_every": 1}, **sections))


def seeded_hf_model(cfg):
    """The whole transformers model, with the initial weights every layout of the run starts from."""
    blocks, _ = build_model(cfg)
    state = {f"blocks.{i}.{n}": p.detach() for i, b in enumerate(blocks) for n, p in b.named_parameters()}
    weights, config = hf_state(state, cfg.model)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # a tied head is the embedding
    return model


def reference(cfg):
    """Single-process transformers on the same batches: losses, eval losses by step, rates, model."""
    model = seeded_hf_model(cfg)
    opt = build_optimizer(model.parameters(), cfg.train)
    train, evald = open_datasets(cfg)
    sampler = make_sampler(cfg, train)
    gb = cfg.train.global_batch_size

    def loss_of(x, y):
        logits = model(input_ids=torch.from_numpy(x)).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(y).reshape(-1))

    losses, evals, lrs = [], {}, []
    for step in range(1, STEPS + 1):
        x, y = train.sample(sampler.rows((step - 1) * gb, gb))
        opt.zero_grad()
        loss = loss_of(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        lrs.append(lr_at(cfg.train, step))
        set_lr(opt, lrs[-1])
        opt.step()
        losses.append(loss.item())
        if step % cfg.eval.every == 0 or step == STEPS:
            model.eval()
            with torch.no_grad():
                evals[step] = sum(loss_of(*evald.sample(np.arange(b * gb, (b + 1) * gb))).item()
                                  for b in range(cfg.eval.batches)) / cfg.eval.batches
            model.train()
    return losses, evals, lrs, model


@pytest.fixture(scope="module")
def cluster5(shared_cluster):
    return shared_cluster.get(5)


@pytest.fixture(scope="module")
def llama_ref(corpus_dir):
    return reference(config(corpus_dir, "ref", LLAMA, 1, 1))


@pytest.fixture(scope="module")
def gpt2_ref(corpus_dir):
    return reference(config(corpus_dir, "ref", GPT2, 1, 1))


def check_against(result, ref, dp, pp):
    losses, evals, lrs, _ = ref
    assert [r["step"] for r in result.history] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in result.history] == pytest.approx(losses, rel=1e-5)
    assert [r["lr"] for r in result.history] == pytest.approx(lrs, rel=1e-12)
    got = {r["step"]: r["eval_loss"] for r in result.history if "eval_loss" in r}
    assert got.keys() == evals.keys() == {3, 6, 8}
    assert [got[s] for s in sorted(got)] == pytest.approx([evals[s] for s in sorted(evals)], rel=1e-5)
    assert (result.history[0]["dp"], result.history[0]["pp"]) == (dp, pp)


def blocks_logits(cfg, state, x):
    """Logits of the trained blocks, run one after another in this process."""
    blocks, _ = build_model(cfg.model, 0)
    model = torch.nn.Sequential(*blocks)
    model.load_state_dict({k.removeprefix("blocks."): v for k, v in state.items()})
    with torch.no_grad():
        return model(x)


def check_export(cfg, result, tmp_path):
    out = tmp_path / "hf-out"
    assert cli_main(["export", result.model_path, "--hf", str(out)]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_logits = loaded(input_ids=x).logits
    state = load_weights(result.model_path)
    torch.testing.assert_close(hf_logits, blocks_logits(cfg, state, x), rtol=1e-5, atol=1e-5)
    # The run wrote the same folder at its end, each pipeline rank its own part, and it loads.
    pp = cfg.parallel.pp
    assert result.hf_path and os.path.isfile(os.path.join(result.hf_path, "config.json"))
    assert sorted(f for f in os.listdir(result.hf_path) if f.endswith(".safetensors")) == [
        f"model-{k:05d}-of-{pp:05d}.safetensors" for k in range(1, pp + 1)]
    own = transformers.AutoModelForCausalLM.from_pretrained(result.hf_path, local_files_only=True)
    with torch.no_grad():
        torch.testing.assert_close(own(input_ids=x).logits, hf_logits, rtol=1e-5, atol=1e-5)
    return state, json.loads((out / "config.json").read_text())


def check_export_on_s3(s3, result, tmp_path, capsys):
    """``elastic-trainer export`` reads the weights from S3 and writes the folder to S3, each URI
    with its secret, which its output does not show."""
    bucket = s3.bucket("export")
    pafs.copy_files(result.model_path, f"{bucket}/run", source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=s3.fs())
    capsys.readouterr()
    assert cli_main(["export", s3.uri(bucket, "run", secret="query"),
                     "--hf", s3.uri(bucket, "hf", secret="userinfo")]) == 0
    said = capsys.readouterr().out
    assert f"s3://{bucket}/hf" in said and s3.secret not in said and quote(s3.secret, safe="") not in said
    local = tmp_path / "from-s3"
    local.mkdir()
    pafs.copy_files(f"{bucket}/hf", str(local), source_filesystem=s3.fs(),
                    destination_filesystem=pafs.LocalFileSystem())
    return transformers.AutoModelForCausalLM.from_pretrained(str(local), local_files_only=True)


def test_llama_2x2_matches_transformers_and_exports(cluster5, corpus_dir, llama_ref, tmp_path, s3, capsys):
    cfg = config(corpus_dir, "llama22", LLAMA, 2, 2)
    result = Trainer(cfg, verbose=False).fit()
    check_against(result, llama_ref, 2, 2)
    _, hf_config = check_export(cfg, result, tmp_path)
    assert hf_config["model_type"] == "llama"
    from_s3 = check_export_on_s3(s3, result, tmp_path, capsys)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(from_s3(input_ids=x).logits,
                                   blocks_logits(cfg, load_weights(result.model_path), x), rtol=1e-5, atol=1e-5)


def test_llama_1x4_matches_transformers(cluster5, corpus_dir, llama_ref):
    result = Trainer(config(corpus_dir, "llama14", LLAMA, 1, 4), verbose=False).fit()
    check_against(result, llama_ref, 1, 4)


@pytest.mark.parametrize("shard", ["none", "gradients"])
def test_gpt2_tied_2x2_matches_transformers_and_exports(cluster5, corpus_dir, gpt2_ref, tmp_path, shard):
    # Sharded, each copy of the tied tensor has its own shard owners: the copies' gradients are
    # summed across the pipeline before they are reduce-scattered.
    cfg = config(corpus_dir, f"gpt222{shard[0]}", GPT2, 2, 2, parallel={"shard_optimizer": shard})
    result = Trainer(cfg, verbose=False).fit()
    check_against(result, gpt2_ref, 2, 2)
    state, _ = check_export(cfg, result, tmp_path)
    # The two copies of the tied tensor took the same updates: still one tensor.
    last = max(int(k.split(".")[1]) for k in state)
    torch.testing.assert_close(state[f"blocks.{last}.lm_head.weight"], state["blocks.0.embed_tokens.weight"],
                               rtol=0, atol=0)
    torch.testing.assert_close(state["blocks.0.embed_tokens.weight"],
                               gpt2_ref[3].transformer.wte.weight.detach(), rtol=1e-4, atol=1e-5)


def test_gpt2_1x4_matches_transformers(cluster5, corpus_dir, gpt2_ref):
    result = Trainer(config(corpus_dir, "gpt214", GPT2, 1, 4), verbose=False).fit()
    check_against(result, gpt2_ref, 1, 4)


def test_node_loss_and_failed_eval_continue_the_curve(cluster5, corpus_dir, llama_ref):
    """Every worker raising inside the evaluation after step 3, then a node lost mid-run: the
    evaluation is redone, the re-plans restore, and losses, rates and eval losses stay on the
    failure-free curve."""
    c, nodes = cluster5
    name = "llamaloss"
    # Each snapshot holds its step 0.3 s, so the node loss lands mid-run (the driver sees steps late).
    cfg = config(corpus_dir, name, LLAMA, 2, 2,
                 scaling={"env_vars": {EVAL_FAULT_ENV: "3", SNAPSHOT_DELAY_ENV: "0.3"}})
    done = set()

    def on_step(rec):
        if rec["step"] >= 4 and not done:
            done.add("kill")
            st = ray.get(ray.get_actor(f"{name}-controller", namespace=NAMESPACE).status.remote())
            node_id = next(w["node_id"] for w in st["workers"] if w["rank"] == 1)
            c.remove_node(next(n for n in nodes if n.node_id == node_id), allow_graceful=False)

    result = Trainer(cfg, verbose=False, on_step=on_step).fit()
    check_against(result, llama_ref, 2, 2)
    failures = [e for e in result.events if e["kind"] == "failure"]
    assert {e["failure"] for e in failures} >= {"exception", "death"}, failures
    assert {e["step"] for e in failures if e["failure"] == "exception"} == {3}
    assert max(e["step"] for e in failures if e["failure"] == "death") < STEPS
    assert len(result.recoveries) >= 2
    evals = [e["step"] for e in result.events if e["kind"] == "eval"]
    # The failed evaluation was redone once (a rolled-back step's evaluation would run again too).
    assert sorted(set(evals)) == [3, 6, 8] and evals.count(3) == 1, evals
