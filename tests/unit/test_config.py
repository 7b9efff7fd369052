import re

import pytest

from elastic_trainer.config import TrainerConfig, apply_overrides
from elastic_trainer.errors import ConfigError

BASE = {"data": {"path": "x"}}


def make(**sections):
    return TrainerConfig.from_dict({**BASE, **sections})


def test_defaults_and_derived_values():
    cfg = make(parallel={"dp": 2, "pp": 2}, train={"global_batch_size": 16, "micro_batch_size": 2})
    assert cfg.world_size == 4
    assert cfg.micro_batches == 4
    assert cfg.model.seq_len == cfg.data.seq_len
    assert cfg.scaling.resolved_backend() == "gloo"


def test_gpu_resources_pick_nccl():
    cfg = make(scaling={"resources_per_worker": {"GPU": 1, "CPU": 4}})
    assert cfg.scaling.resolved_backend() == "nccl"


@pytest.mark.parametrize("raw, key", [
    ({**BASE, "trian": {}}, "trian"),
    ({**BASE, "train": {"stepz": 3}}, "train.stepz"),
    ({**BASE, "failure": {"retriez": 3}}, "failure.retriez"),
])
def test_unknown_key_is_named(raw, key):
    with pytest.raises(ConfigError) as e:
        TrainerConfig.from_dict(raw)
    assert f"{key}: unknown key" in str(e.value)


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(ConfigError, match=r"allowed: .*global_batch_size"):
        make(train={"stepz": 3})


def test_dp_pp_mismatch_names_every_factor():
    with pytest.raises(ConfigError, match=r"dp\(2\) \* pp\(3\) = 6 != num_workers\(4\)"):
        make(parallel={"dp": 2, "pp": 3}, scaling={"num_workers": 4})


def test_batch_that_does_not_divide():
    with pytest.raises(ConfigError, match=r"global_batch_size\(30\) is not divisible by dp\(2\) \* micro_batch_size\(4\) = 8"):
        make(parallel={"dp": 2}, train={"global_batch_size": 30, "micro_batch_size": 4})


def test_interleaved_needs_pipeline():
    with pytest.raises(ConfigError, match=r"needs pp >= 2"):
        make(parallel={"schedule": "interleaved"})


def test_1f1b_needs_a_micro_batch_per_stage():
    # torch's 1F1B refuses it on every rank at set-up; the config says so before anything starts.
    with pytest.raises(ConfigError, match=r"schedule '1f1b' needs .* = 2 < pp\(3\)"):
        make(model={"n_layer": 4}, parallel={"dp": 2, "pp": 3}, train={"global_batch_size": 16, "micro_batch_size": 4})
    make(model={"n_layer": 4}, parallel={"dp": 2, "pp": 3, "schedule": "gpipe"},
         train={"global_batch_size": 16, "micro_batch_size": 4})


def test_too_many_stages_for_the_gpt():
    with pytest.raises(ConfigError, match=r"6 blocks .* fewer than the 8 pipeline stages"):
        make(model={"n_layer": 4}, parallel={"pp": 8}, train={"global_batch_size": 8, "micro_batch_size": 1})


def test_bad_schedule_and_factory_form():
    with pytest.raises(ConfigError, match=r"parallel.schedule"):
        make(parallel={"schedule": "zigzag"})
    with pytest.raises(ConfigError, match=r"not of the form 'package.module:function'"):
        make(model={"factory": "no_colon_here"})


def test_data_longer_than_model_context():
    with pytest.raises(ConfigError, match=r"data.seq_len\(64\) > model.seq_len\(32\)"):
        make(model={"seq_len": 32}, data={"path": "x", "seq_len": 64})


def test_missing_data_section():
    with pytest.raises(ConfigError, match=r"data: required"):
        TrainerConfig.from_dict({})


def test_overrides_parse_yaml_scalars():
    raw = apply_overrides(BASE, ["train.steps=7", "parallel.schedule=gpipe", "train.grad_clip=0.5", "run.name=abc"])
    cfg = TrainerConfig.from_dict(raw)
    assert (cfg.train.steps, cfg.parallel.schedule, cfg.train.grad_clip, cfg.run.name) == (7, "gpipe", 0.5, "abc")
    assert BASE == {"data": {"path": "x"}}  # the input is not mutated


def test_override_errors():
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_overrides(BASE, ["train.steps"])
    with pytest.raises(ConfigError, match="train.stepz: unknown key"):
        TrainerConfig.from_dict(apply_overrides(BASE, ["train.stepz=1"]))


def test_from_yaml(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("data: {path: /d}\nparallel: {dp: 2}\n")
    cfg = TrainerConfig.from_yaml(p, ["parallel.pp=2"])
    assert (cfg.parallel.dp, cfg.parallel.pp) == (2, 2)
    with pytest.raises(ConfigError, match="does not exist"):
        TrainerConfig.from_yaml(tmp_path / "nope.yaml")
    p.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        TrainerConfig.from_yaml(p)


def test_shipped_job_files_are_valid():
    from pathlib import Path

    jobs = sorted((Path(__file__).parents[2] / "jobs").glob("*.yaml"))
    assert len(jobs) >= 2
    for job in jobs:
        TrainerConfig.from_yaml(job)


@pytest.mark.parametrize("comm, message", [
    ({"sync": "diloco", "compression": "int8"}, r"comm.compression\('int8'\) and comm.algorithm\('ring'\) apply to "
                                                r"comm.sync 'allreduce' only.*compression at 'none', 'fp16' or 'bf16'"),
    ({"sync": "parameter_server", "compression": "fp16"}, r"not 'parameter_server'.*compression at 'none'$"),
    ({"algorithm": "tree", "compression": "topk"}, r"comm.algorithm\('tree'\) replaces an all-reduce; comm.compression\('topk'\)"),
    ({"compression": "zip"}, r"comm.compression: Input should be 'none', 'fp16'"),
    ({"topk_ratio": 0}, r"comm.topk_ratio: Input should be greater than 0"),
])
def test_comm_choices_that_do_not_fit_say_what_would(comm, message):
    with pytest.raises(ConfigError, match=message):
        make(comm=comm)


@pytest.mark.parametrize("name", ["../etc", "a b", ".hidden", "x/y", "", "n" * 101])
def test_a_run_name_that_cannot_be_an_actor_or_file_name_is_refused(name):
    with pytest.raises(ConfigError, match=r"run.name\(.*\) must be letters, digits"):
        TrainerConfig.from_dict({"data": {"path": "/tmp/x"}, "run": {"name": name}})


def test_run_names_of_letters_digits_dots_and_dashes_pass():
    for name in ("et-20261201-124623", "gpt_small.run1", "overlapTrue"):
        assert TrainerConfig.from_dict({"data": {"path": "/tmp/x"}, "run": {"name": name}}).run.name == name


@pytest.mark.parametrize("ev, message", [
    ({"path": "v", "fraction": 0.1}, "eval.path('v') and eval.fraction(0.1) both given"),
    ({"every": 5}, "eval.every(5) needs eval.path or eval.fraction"),
    ({"fraction": 1.5, "every": 5}, "eval.fraction"),
])
def test_eval_sections_that_cannot_run_say_why(ev, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainerConfig.from_dict({"data": {"path": "x"}, "eval": ev})


def test_an_eval_set_too_small_for_its_batches_is_a_data_error(corpus_dir):
    from elastic_trainer.data.splits import open_datasets
    from elastic_trainer.errors import DataError

    cfg = TrainerConfig.from_dict({"data": {"path": corpus_dir, "seq_len": 16},
                                   "eval": {"fraction": 0.001, "every": 2, "batches": 8}})
    with pytest.raises(DataError, match=r"eval.fraction\(0.001\) .* holds \d+ windows .* = 128"):
        open_datasets(cfg)
    train, evald = open_datasets(cfg.with_overrides(["eval.fraction=0.1"]))
    assert len(train) + len(evald) == len(open_datasets(cfg.with_overrides(["eval.every=null"]))[0])


# -- YAML 1.1 reads off/on/yes/no as booleans ---------------------------------------------------

# The spellings PyYAML's safe_load turns into booleans (YAML 1.1), by the boolean they become.
YAML_BOOL_WORDS = {False: ("off", "no", "false"), True: ("on", "yes", "true")}


def _literal_words(annotation) -> set[str]:
    """The string values a field's annotation allows through ``Literal`` (any depth of unions)."""
    from typing import Literal, get_args, get_origin

    if get_origin(annotation) is Literal:
        return {a for a in get_args(annotation) if isinstance(a, str)}
    return set().union(*(_literal_words(a) for a in get_args(annotation))) if get_args(annotation) else set()


def _worded_fields() -> list[tuple[str, str, str]]:
    """(section, key, word) for every config field whose allowed words include a YAML 1.1 boolean."""
    spellings = {w for words in YAML_BOOL_WORDS.values() for w in words}
    out = []
    for section, field in TrainerConfig.model_fields.items():
        for key, f in field.annotation.model_fields.items():
            out += [(section, key, w) for w in sorted(_literal_words(f.annotation) & spellings)]
    return out


def test_every_worded_field_is_found():
    # balance.mode's 'off' is documented in the README; the sweep below would pass vacuously without it.
    assert ("balance", "mode", "off") in _worded_fields()


@pytest.mark.parametrize("section, key, word", _worded_fields())
def test_a_word_yaml_reads_as_a_boolean_is_taken_as_written(tmp_path, section, key, word):
    job = tmp_path / "job.yaml"
    job.write_text(f"data: {{path: /d}}\n{section}:\n  {key}: {word}\n")
    assert getattr(getattr(TrainerConfig.from_yaml(job), section), key) == word
    job.write_text("data: {path: /d}\n")
    assert getattr(getattr(TrainerConfig.from_yaml(job, [f"{section}.{key}={word}"]), section), key) == word
    assert getattr(getattr(make().with_overrides([f"{section}.{key}={word}"]), section), key) == word


def test_balance_mode_off_in_a_shipped_job_and_through_set():
    from pathlib import Path

    demo = Path(__file__).parents[2] / "jobs" / "demo.yaml"
    cfg = TrainerConfig.from_yaml(demo, ["balance.mode=off"])
    assert cfg.balance.mode == "off"
    assert cfg.with_overrides(["balance.mode=detect"]).with_overrides(["balance.mode=off"]).balance.mode == "off"
    cfg.balance.mode = False   # assignment is validated the same way
    assert cfg.balance.mode == "off"


def test_a_boolean_word_a_field_does_not_take_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"balance.mode: .*boolean True.*'off', 'detect', 'act'"):
        make().with_overrides(["balance.mode=on"])


@pytest.mark.parametrize("key, word", [("checkpoint.memory_every", "on"), ("checkpoint.memory_every", "yes"),
                                       ("data.shuffle_mix", "true"), ("data.shuffle_mix", "off")])
def test_a_number_or_auto_field_refuses_a_boolean_rather_than_read_it_as_1_or_0(key, word):
    # pydantic would take True as 1 here: `memory_every: on` snapshotting every step.
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: .*boolean"):
        make().with_overrides([f"{key}={word}"])
    section, name = key.split(".")
    assert getattr(getattr(make().with_overrides([f"{key}=auto"]), section), name) == "auto"
    assert getattr(getattr(make().with_overrides([f"{key}=3"]), section), name) == 3


@pytest.mark.parametrize("key, word, value", [("comm.overlap", "false", False), ("comm.overlap", "true", True),
                                              ("control.renew_early", "off", False),
                                              ("data.shuffle", "no", False), ("checkpoint.overlap", "yes", True)])
def test_a_boolean_field_still_takes_booleans(tmp_path, key, word, value):
    section, name = key.split(".")
    job = tmp_path / "job.yaml"
    job.write_text(f"data: {{path: /d, {name}: {word}}}\n" if section == "data"
                   else f"data: {{path: /d}}\n{section}: {{{name}: {word}}}\n")
    assert getattr(getattr(TrainerConfig.from_yaml(job), section), name) is value
    assert getattr(getattr(make().with_overrides([f"{key}={word}"]), section), name) is value


def test_a_text_field_given_a_yaml_boolean_says_to_quote_it():
    with pytest.raises(ConfigError, match=r"run.name: .*given False.*quote"):
        make().with_overrides(["run.name=no"])


@pytest.mark.parametrize("comm", [{"compression": "int8"}, {"sync": "local_sgd"}, {"algorithm": "tree"}])
def test_a_sharded_optimizer_refuses_an_exchange_it_cannot_shard(comm):
    with pytest.raises(ConfigError, match=r"parallel\.shard_optimizer\('gradients'\) reduce-scatters the gradients.*"
                                          r"use sync 'allreduce', algorithm 'ring' and compression none, fp16 or bf16"):
        TrainerConfig.from_dict({"data": {"path": "/d"}, "parallel": {"dp": 2, "shard_optimizer": "gradients"},
                                 "comm": comm})
    # auto leaves such a run whole instead of refusing it.
    assert TrainerConfig.from_dict({"data": {"path": "/d"}, "parallel": {"dp": 2}, "comm": comm}).parallel.shard_optimizer == "auto"
