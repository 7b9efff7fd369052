"""A balancing decision reaches growth as a re-plan request, from the value Balance.act returns."""

from types import SimpleNamespace

from elastic_trainer.controller.balance.stragglers import Moves
from elastic_trainer.controller.step_loop import StepLoop


class _Growth:
    def __init__(self, pending=False):
        self.asked, self.pending = [], pending

    def replan_pending(self):
        return self.pending

    def request_replan(self, reason, cut=None):
        self.asked.append((reason, cut))


def _loop(growth, bench_result=7, bench_raises=False):
    refused = []

    def bench(rank, pace, step):
        if bench_raises:
            raise RuntimeError("probe table broken")
        return bench_result

    events = []
    run = SimpleNamespace(name="r", event=lambda kind, **kw: events.append((kind, kw)))
    balance = SimpleNamespace(bench_refused=lambda: refused.append(True))
    loop = StepLoop(None, run, None, None, balance, SimpleNamespace(bench=bench), None, None, None, growth, None,
                    None, None, lambda: None)
    return loop, refused, events


def test_a_spare_or_a_recut_becomes_a_replan_request():
    rec = _Growth()
    loop, refused, _ = _loop(rec)
    loop._carry_out(Moves([{"kind": "rebalance"}], bench=(1, 2.5)), step=9)
    assert rec.asked == [("straggler", None)] and not refused
    cut = ((0, 4), (4, 6))
    loop._carry_out(Moves([], cut=cut), step=10)
    assert rec.asked[-1] == ("recut", cut)
    # A re-plan already asked for goes first: the re-cut is not asked on top.
    busy = _Growth(pending=True)
    _loop(busy)[0]._carry_out(Moves([], cut=cut), step=11)
    assert busy.asked == []


def test_a_spare_whose_worker_is_gone_is_refused_and_an_error_never_ends_the_run():
    rec = _Growth()
    loop, refused, _ = _loop(rec, bench_result=None)
    loop._carry_out(Moves([], bench=(1, 2.5)), step=9)
    assert rec.asked == [] and refused == [True]   # Balance stops waiting for a re-plan that is not coming
    loop, _, events = _loop(rec, bench_raises=True)
    loop._carry_out(Moves([], bench=(1, 2.5)), step=9)
    assert [k for k, _ in events] == ["balance_problem"] and "probe table broken" in events[0][1]["detail"]
