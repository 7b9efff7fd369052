"""When the controller evaluates: after every ``eval.every`` steps and after the last, once per
step, and again for steps a rollback will run again."""

from types import SimpleNamespace

from elastic_trainer.config import TrainerConfig
from elastic_trainer.controller.stepping.evaluation import Evaluator


def evaluator(every=3, steps=8):
    cfg = TrainerConfig.from_dict({"data": {"path": "x"}, "train": {"steps": steps},
                                   "eval": {"fraction": 0.1, "every": every}})
    return Evaluator(cfg, SimpleNamespace(step=0), pool=None, driver=None)


def test_due_after_every_n_steps_and_the_last_once():
    ev = evaluator()
    due = []
    for step in range(0, 9):
        ev.run.step = step
        if ev.due():
            due.append(step)
            ev.done[step] = 1.0
            assert not ev.due()  # once per step
    assert due == [3, 6, 8]


def test_a_rollback_makes_later_evaluations_due_again():
    ev = evaluator()
    ev.done = {3: 1.0, 6: 0.9}
    ev.rolled_back(5)
    assert ev.done == {3: 1.0}
    ev.run.step = 6
    assert ev.due()
    ev.run.step = 3
    assert not ev.due()


def test_nothing_is_due_without_eval_every():
    ev = Evaluator(TrainerConfig.from_dict({"data": {"path": "x"}}), SimpleNamespace(step=5), pool=None, driver=None)
    assert not ev.due()
