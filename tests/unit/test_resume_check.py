"""What --resume lets change: the layout freely; the schedule (steps, learning rate) when the user
says so; never the model, data, seed, batch, optimizer or precision. And how it is asked for."""

import pytest

from elastic_trainer.checkpoint.compat import ACCEPTABLE, resume_check, resume_request
from elastic_trainer.cli.commands import build_parser
from elastic_trainer.config import TrainerConfig
from elastic_trainer.errors import ConfigError

from ..conftest import tiny_config


def cfg(**sections) -> dict:
    run = {"name": "r", **sections.pop("run", {})}
    return TrainerConfig.from_dict(tiny_config("/data", run=run, **sections)).model_dump(mode="json")


def test_the_layout_and_the_way_a_run_is_operated_may_change():
    other = cfg(parallel={"dp": 2, "pp": 2}, train={"micro_batch_size": 2}, run={"name": "r2"},
                checkpoint={"storage": "/ck", "keep_durable": 5}, failure={"max_failures": 9},
                comm={"timeout_s": 9, "bucket_mb": 1}, scaling={"num_workers": 4})
    assert resume_check(cfg(), other, None, None, step=4) == ([], [])


@pytest.mark.parametrize("sections, field", [
    ({"train": {"lr": 2e-3}}, "train.lr: checkpoint 0.001, this run 0.002"),
    ({"train": {"steps": 9}}, "train.steps: checkpoint 5, this run 9"),
    ({"train": {"lr_schedule": "cosine"}}, "train.lr_schedule: checkpoint 'constant', this run 'cosine'"),
    ({"train": {"precision": "bf16"}}, "train.precision: checkpoint 'fp32', this run 'bf16'"),
    ({"train": {"weight_decay": 0.1}}, "train.weight_decay: checkpoint 0.01, this run 0.1"),
    ({"train": {"betas": [0.9, 0.95]}}, "train.betas: checkpoint None, this run [0.9, 0.95]"),
    ({"train": {"global_batch_size": 16}}, "train.global_batch_size: checkpoint 8, this run 16"),
    ({"train": {"seed": 2}}, "train.seed: checkpoint 1, this run 2"),
    ({"model": {"d_model": 64}}, "model.d_model: checkpoint 32, this run 64"),
    ({"data": {"shuffle": False}}, "data.shuffle: checkpoint True, this run False"),
    ({"comm": {"compression": "int8"}}, "comm.compression: checkpoint 'none', this run 'int8'"),
])
def test_every_other_change_is_refused_naming_both_values(sections, field):
    accepted, refused = resume_check(cfg(), cfg(**sections), None, None, step=4)
    assert (accepted, refused) == ([], [field])


def test_the_schedule_may_change_when_accepted_and_is_listed():
    changed = cfg(train={"steps": 9, "lr": 2e-3, "seed": 2})
    accepted, refused = resume_check(cfg(), changed, None, None, step=4, accept=["train.steps", "train.lr"])
    assert accepted == [{"field": "train.lr", "checkpoint": 1e-3, "run": 2e-3},
                        {"field": "train.steps", "checkpoint": 5, "run": 9}]
    assert refused == ["train.seed: checkpoint 1, this run 2"]


def test_fewer_steps_than_the_checkpoint_has_are_refused_even_when_accepted():
    _, refused = resume_check(cfg(train={"steps": 9}), cfg(train={"steps": 3}), None, None, step=6,
                              accept=["train.steps"])
    assert refused == ["train.steps: this run stops at step 3, before the checkpoint's step 6"]


def test_data_fingerprints_must_match():
    _, refused = resume_check(cfg(), cfg(), {"rows": 10, "order": [1, 10]}, {"rows": 9, "order": [1, 9]}, step=2)
    assert refused == ["data (order): checkpoint [1, 10], this run [1, 9]", "data (rows): checkpoint 10, this run 9"]


def test_what_a_resume_asks_for():
    assert resume_request(False, (), "r") is None
    assert resume_request(True, (), "r") == {"target": None, "accept": []}
    assert resume_request("abc123", "train.steps, train.lr", None) == {"target": "abc123",
                                                                      "accept": ["train.lr", "train.steps"]}
    with pytest.raises(ConfigError, match=r"resume by name needs run.name"):
        resume_request(True, (), None)
    with pytest.raises(ConfigError, match=r"accept_change\(\['train.lr'\]\) needs resume"):
        resume_request(False, ["train.lr"], "r")
    with pytest.raises(ConfigError, match=r"model.d_model cannot change on a resume; it accepts "
                                           + ", ".join(ACCEPTABLE)):
        resume_request(True, ["model.d_model"], "r")
    # A checkpoint path is made absolute here: the controller runs in another working directory.
    assert resume_request("ck/step-00000004-abc", (), "r")["target"].startswith("/")


def test_the_command_line_asks_the_same():
    args = build_parser().parse_args(["run", "j.yaml", "--resume", "--accept-change", "train.steps,train.lr"])
    assert (args.resume, args.resume_from, args.accept_change) == (True, None, ["train.steps,train.lr"])
    args = build_parser().parse_args(["run", "j.yaml", "--resume-from", "ck/step-00000040-abc",
                                      "--accept-change", "train.steps", "--accept-change", "train.lr"])
    assert args.resume_from == "ck/step-00000040-abc" and args.accept_change == ["train.steps", "train.lr"]


def test_accepting_a_change_without_resuming_is_an_error_on_the_command_line(capsys):
    from elastic_trainer.cli.commands import main

    assert main(["run", "jobs/demo.yaml", "--accept-change", "train.lr"]) == 2
    assert "--accept-change train.lr names what a resumed run may change: add --resume" in capsys.readouterr().err
