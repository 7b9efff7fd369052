"""The learning rate is a pure function of the step: warm-up, then constant, cosine or linear decay."""

import math

import pytest

from elastic_trainer.config import TrainSection
from elastic_trainer.errors import ConfigError
from elastic_trainer.config import TrainerConfig
from elastic_trainer.lr_schedule import lr_at


def train(**kw):
    return TrainSection(**{"steps": 10, "lr": 1.0, **kw})


def test_constant_with_warmup():
    t = train(warmup_steps=4)
    assert [lr_at(t, s) for s in range(1, 7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_at(train(), 1) == 1.0


def test_cosine_decays_from_lr_toward_min_lr():
    t = train(lr_schedule="cosine", warmup_steps=2, min_lr=0.1)
    # Steps 3..10 are the 8 decay steps: progress (s - 1 - 2) / 8.
    want = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 3) / 8)) for s in range(3, 11)]
    assert [lr_at(t, s) for s in range(1, 11)] == pytest.approx(want, rel=1e-12)
    assert lr_at(t, 10) > 0.1  # the last step still moves


def test_linear_decay():
    t = train(lr_schedule="linear", min_lr=0.0)
    assert [lr_at(t, s) for s in (1, 6, 10)] == pytest.approx([1.0, 0.5, 0.1])


def test_same_rate_whatever_was_asked_before():
    t = train(lr_schedule="cosine", warmup_steps=3)
    forward = [lr_at(t, s) for s in range(1, 11)]
    assert [lr_at(t, s) for s in reversed(range(1, 11))] == forward[::-1]


@pytest.mark.parametrize("train_kw, msg", [
    ({"min_lr": 2.0, "lr": 1.0}, "train.min_lr(2.0) > train.lr(1.0)"),
    ({"lr_schedule": "cosine", "warmup_steps": 10, "steps": 10}, "leaves no decay"),
])
def test_bad_schedules_are_config_errors(train_kw, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        TrainerConfig.from_dict({"data": {"path": "x"}, "train": train_kw})
