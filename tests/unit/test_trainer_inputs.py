"""Bad data and bad factories fail in the driver, before Ray starts or any worker exists."""

import pytest

from elastic_trainer import DataError, ModelError, Trainer, TrainerConfig

from ..conftest import tiny_config


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    """Any attempt to reach Ray fails the test: these errors must come first."""
    def refuse(self, cfg):
        raise AssertionError("Trainer tried to connect to Ray before checking its inputs")

    monkeypatch.setattr(Trainer, "_connect", refuse)


def test_missing_data_fails_before_ray_starts(tmp_path):
    cfg = TrainerConfig.from_dict(tiny_config(str(tmp_path / "nothing-here")))
    with pytest.raises(DataError, match="does not exist"):
        Trainer(cfg, verbose=False).fit()


def test_corrupt_data_fails_before_ray_starts(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"garbage")
    cfg = TrainerConfig.from_dict(tiny_config(str(tmp_path / "x.parquet")))
    with pytest.raises(DataError, match="not readable Parquet"):
        Trainer(cfg, verbose=False).fit()


def test_factory_that_does_not_import_fails_before_ray_starts(corpus_dir):
    cfg = TrainerConfig.from_dict(tiny_config(corpus_dir, model={"kind": "factory", "factory": "nope.mod:build"}))
    with pytest.raises(ModelError, match="cannot import 'nope.mod'"):
        Trainer(cfg, verbose=False).fit()


def test_a_missing_or_bad_constants_file_fails_before_ray_starts(corpus_dir, tmp_path):
    from elastic_trainer import ConfigError

    cfg = TrainerConfig.from_dict(tiny_config(corpus_dir, comm={"constants": str(tmp_path / "none.json")}))
    with pytest.raises(ConfigError, match="none.json' does not exist; write one with `elastic-trainer bench-comm"):
        Trainer(cfg, verbose=False).fit()
    (tmp_path / "bad.json").write_text('{"algorithms": {"tree": {"alpha_s": 1, "beta_s_per_byte": 1}}}')
    cfg = TrainerConfig.from_dict(tiny_config(corpus_dir, comm={"constants": str(tmp_path / "bad.json")}))
    with pytest.raises(ConfigError, match="no 'ring' entry"):
        Trainer(cfg, verbose=False).fit()


def test_token_ids_beyond_the_vocabulary_fail_before_ray_starts(tmp_path, corpus_dir):
    # The byte corpus holds ids up to 255 or so; a 64-token vocabulary has no embedding for them.
    cfg = TrainerConfig.from_dict(tiny_config(corpus_dir, model={"vocab_size": 64}))
    with pytest.raises(DataError, match=r"holds token ids up to \d+, but the model's vocabulary has 64"):
        Trainer(cfg, verbose=False).fit()
    hf = {"model_type": "gpt2", "vocab_size": 100, "n_embd": 8, "n_layer": 1, "n_head": 2}
    cfg = TrainerConfig.from_dict(tiny_config(corpus_dir, model={"kind": "hf", "hf_config": hf}))
    with pytest.raises(DataError, match="vocabulary has 100"):
        Trainer(cfg, verbose=False).fit()
