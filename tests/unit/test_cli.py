import json

import pytest

from elastic_trainer.cli.commands import build_parser, main


@pytest.mark.parametrize("argv", [[], ["run"], ["plan"], ["bench-comm"], ["prepare-data"]])
def test_help_on_every_command(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, "--help"])
    assert e.value.code == 0
    assert "usage: elastic-trainer" in capsys.readouterr().out


def test_plan_prints_the_stage_cut(capsys):
    assert main(["plan", "jobs/gpt_gpu.yaml", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["dp"], plan["pp"], plan["world_size"], plan["backend"]) == (4, 2, 8, "nccl")
    assert plan["stages"][0]["blocks"][0] == 0 and plan["stages"][-1]["blocks"][1] == 26
    assert plan["micro_batches_per_replica"] == 8


def test_errors_are_one_line_not_a_traceback(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("data: {path: x}\nparallel: {dp: 2, pp: 3}\nscaling: {num_workers: 4}\n")
    assert main(["plan", str(job)]) == 2
    assert "dp(2) * pp(3) = 6 != num_workers(4)" in capsys.readouterr().err


def test_prepare_data(tmp_path, capsys):
    assert main(["prepare-data", "--out", str(tmp_path / "c"), "--seq-len", "32", "--max-mb", "0.05"]) == 0
    assert "rows of 33 byte tokens" in capsys.readouterr().out


def test_slow_rank_makes_a_straggler_of_one_worker_and_checks_its_arguments():
    from elastic_trainer.cli.commands import _with_straggler
    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.errors import ConfigError

    cfg = TrainerConfig.from_yaml("jobs/demo.yaml")
    slow = _with_straggler(cfg, 3, 2.5)
    assert slow.scaling.env_vars == {"ELASTIC_TRAINER_SLOW_RANK": "3", "ELASTIC_TRAINER_SLOW_FACTOR": "2.5"}
    assert slow.failure.allow_fault_injection and not cfg.failure.allow_fault_injection
    with pytest.raises(ConfigError, match=r"--slow-rank 4 is not a rank of dp=2 x pp=2 \(0..3\)"):
        _with_straggler(cfg, 4, 2.0)
    with pytest.raises(ConfigError, match="--slow-factor 1 must be above 1"):
        _with_straggler(cfg, 0, 1.0)
    args = build_parser().parse_args(["run", "jobs/demo.yaml", "--slow-rank", "1", "--slow-factor", "3"])
    assert (args.slow_rank, args.slow_factor) == (1, 3.0)


def test_the_straggler_demo_says_when_no_share_can_move():
    from elastic_trainer.cli.commands import balancing_hint
    from elastic_trainer.config import TrainerConfig

    demo = TrainerConfig.from_yaml("jobs/demo.yaml")   # dp=2 x pp=2, 2 micro-batches a replica under 1F1B
    assert "--set train.micro_batch_size=1 gives 8 per replica" in balancing_hint(demo)
    assert balancing_hint(demo.with_overrides(["train.micro_batch_size=1"])) is None
    assert balancing_hint(demo.with_overrides(["balance.mode=detect"])) is None


def test_the_command_imports_a_factory_beside_the_job(tmp_path, monkeypatch, capsys):
    """As `python -m elastic_trainer` does: a user's model module in the working directory imports."""
    import sys

    from elastic_trainer.cli import main as command

    (tmp_path / "usermix_model.py").write_text(
        "from torch import nn\n"
        "def build(only_blocks=None):\n"
        "    return [nn.Embedding(16, 8), nn.Linear(8, 16)], nn.CrossEntropyLoss()\n")
    (tmp_path / "job.yaml").write_text(
        "model: {factory: 'usermix_model:build'}\ndata: {path: x, seq_len: 8}\n"
        "parallel: {dp: 1, pp: 2}\ntrain: {global_batch_size: 2, micro_batch_size: 1}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert command(["plan", "job.yaml", "--json"]) == 0
    assert [s["params"] for s in json.loads(capsys.readouterr().out)["stages"]] == [128, 144]
