"""Every job file in jobs/ runs to the end, cut to a tiny size: its model kind and schedule, its
data prepared its own way (the byte corpus, or text tokenized by its data.prepare recipe with the
tokenizer and vocabulary it names), on the shared four-node CPU cluster."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from elastic_trainer import Trainer, TrainerConfig
from elastic_trainer.data.prepare import read_prepared

from ..conftest import SEQ_LEN, weights_dir
from .conftest import NUM_NODES

pytestmark = pytest.mark.integration

JOBS = sorted((Path(__file__).resolve().parents[2] / "jobs").glob("*.yaml"))


@pytest.fixture(scope="module")
def corpus_text(corpus_dir, tmp_path_factory) -> Path:
    """The corpus fixture's bytes back as text: Parquet documents of a string column ``text``."""
    data = b"".join(bytes(r) for r in pq.read_table(corpus_dir).column("tokens").to_pylist())
    lines = data.decode("utf-8", errors="replace").splitlines()
    docs = ["\n".join(lines[i:i + 40]) for i in range(0, len(lines), 40)]
    out = tmp_path_factory.mktemp("text") / "docs.parquet"
    pq.write_table(pa.table({"text": docs}), out)
    return out


def tiny(job: dict, name: str, corpus_dir: str, corpus_text: Path, data_dir: Path) -> dict:
    """``job`` at a size that steps in well under a second on one-CPU nodes, its kind, schedule,
    evaluation, tokenizer recipe and vocabulary kept."""
    job = {k: dict(v) if isinstance(v, dict) else v for k, v in job.items()}
    model = job.setdefault("model", {})
    if model.get("kind", "gpt") == "gpt":
        model.update(n_layer=2, n_head=2, d_model=32, seq_len=SEQ_LEN)
    elif model["kind"] == "hf":
        hf = dict(model["hf_config"])
        hf.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=min(hf.get("num_key_value_heads", 2), 2), max_position_embeddings=2 * SEQ_LEN)
        model["hf_config"] = hf
    data = job["data"]
    recipe = data.get("prepare")
    if isinstance(recipe, dict):   # the job's tokenizer on the corpus fixture's text, into a folder of the test's
        data.update(path=str(data_dir), prepare={**recipe, "input": str(corpus_text), "column": "text"})
    else:                          # the byte corpus: the fixture is that already
        data.update(path=corpus_dir, prepare=None)
    data["seq_len"] = SEQ_LEN
    ev = job.get("eval")
    if ev and ev.get("every"):
        job["eval"] = {**ev, "every": 1, "batches": 1}
    p = job.setdefault("parallel", {})
    pp = min(p.get("pp", 1), 2)
    p.update(pp=pp, dp=min(p.get("dp", 1), NUM_NODES // pp))
    t = job["train"]
    t.update(steps=2, global_batch_size=2 * p["dp"] * pp, micro_batch_size=1)
    if t.get("warmup_steps"):
        t["warmup_steps"] = 1
    job["scaling"] = {**job.get("scaling", {}), "resources_per_worker": {"CPU": 1}, "backend": "gloo",
                      "placement_timeout_s": 60}
    job["comm"] = {**job.get("comm", {}), "timeout_s": 60}
    job["run"] = {**job.get("run", {}), "name": name, "log_every": 1000, "report_dir": None,
                  "output_dir": f"{weights_dir()}/{name}"}
    return job


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", JOBS, ids=[p.stem for p in JOBS])
def test_job_runs_at_a_tiny_size(cluster, corpus_dir, corpus_text, tmp_path, path):
    job = yaml.safe_load(path.read_text())
    cfg = TrainerConfig.model_validate(tiny(job, f"job-{path.stem.replace('_', '-')}", corpus_dir, corpus_text,
                                            tmp_path / "data"))
    result = Trainer(cfg, verbose=False).fit()
    assert result.state == "FINISHED" and result.step == 2
    assert all(r["loss"] == r["loss"] for r in result.history)   # no NaN
    recipe = job["data"].get("prepare")
    if isinstance(recipe, dict):
        # Tokenized the job's way: its tokenizer, saved beside the rows, with ids the model has embeddings for.
        info = read_prepared(tmp_path / "data")
        assert (tmp_path / "data" / "_tokenizer.json").is_file()
        vocab = job["model"].get("vocab_size") or job["model"]["hf_config"]["vocab_size"]
        assert 256 < info["vocab_size"] <= vocab and info["max_token_id"] < vocab
        assert recipe.get("vocab_size") in (None, vocab)
