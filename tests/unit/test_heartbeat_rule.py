"""The heartbeat's rule on a clock of the test's own: a rank is silent once it has gone unheard of
for the whole timeout since it was last heard, with a question out to it; a rank that answers is
never silent."""

from types import SimpleNamespace

import pytest

from elastic_trainer.controller.stepping import heartbeat as hb


class Ref:
    def __init__(self):
        self.ready, self.value = False, None


class Node:
    """A worker asked by the heartbeat: answers each question by the next tick, unless frozen."""

    def __init__(self):
        self.frozen, self.asked = False, 0

    @property
    def ping_node(self):
        return SimpleNamespace(remote=self._ask)

    def _ask(self, mates):
        self.asked += 1
        ref = Ref()
        if not self.frozen:
            ref.ready, ref.value = True, {}
        return ref


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    fake_ray = SimpleNamespace(wait=lambda refs, num_returns=1, timeout=None: ([r for r in refs if r.ready], []),
                               get=lambda ref, timeout=None: ref.value)
    monkeypatch.setattr(hb, "ray", fake_ray)
    monkeypatch.setattr(hb.time, "perf_counter", lambda: now[0])
    return now


def run_until_silent(beat: hb.Heartbeat, clock, pending: list[int], end: float) -> tuple[list[int], float]:
    """As the step's wait does: take each answer as it comes (10 ms after its question here), and
    tick at each ``next_at``; until some rank is silent, or ``end``."""
    while clock[0] < end:
        clock[0] += 0.01
        for ref in [r for r in beat.refs if r.ready]:
            beat.answer(ref)
        clock[0] = max(clock[0], beat.next_at)
        silent = beat.tick(pending)
        if silent:
            return silent, clock[0]
    return [], clock[0]


def test_silence_counts_from_the_last_answer_not_the_first_unanswered_question(clock):
    nodes = {0: Node(), 1: Node()}
    beat = hb.Heartbeat(1.0, 0.0, nodes)
    # Both answer the first rounds; then rank 1 freezes.
    silent, _ = run_until_silent(beat, clock, [0, 1], 0.6)
    assert silent == [] and 1 in beat.heard
    nodes[1].frozen = True   # the question already out still answers
    silent, at = run_until_silent(beat, clock, [0, 1], 10.0)
    assert silent == [1]
    last_heard = beat.heard[1]
    assert last_heard > 0.6
    # Lost once the whole timeout has passed since it was last heard, not before; counted from the
    # first question it left unanswered (a quarter after its last answer) it would be later.
    assert at == pytest.approx(last_heard + 1.0)
    assert at < beat.waiting[1] + 1.0


def test_a_rank_never_heard_is_silent_a_timeout_after_its_step_began(clock):
    nodes = {0: Node(), 1: Node()}
    nodes[1].frozen = True
    beat = hb.Heartbeat(1.0, 0.0, nodes)
    silent, at = run_until_silent(beat, clock, [0, 1], 10.0)
    assert silent == [1] and at == pytest.approx(1.0)


def test_a_rank_that_answers_is_never_silent(clock):
    nodes = {0: Node(), 1: Node()}
    beat = hb.Heartbeat(1.0, 0.0, nodes)
    silent, at = run_until_silent(beat, clock, [0, 1], 20.0)
    assert silent == [] and at >= 20.0
    assert nodes[0].asked >= 70 and nodes[1].asked >= 70   # every quarter of the timeout


def test_a_question_just_sent_gets_a_quarter_of_the_timeout_to_be_answered(clock):
    # A rank not asked for a while (its node's question went through a busy relay, say): unheard
    # past the timeout, but asked only now. It is not lost before that question could come back.
    nodes = {0: Node(), 1: Node()}
    nodes[1].frozen = True
    beat = hb.Heartbeat(1.0, 0.0, nodes)
    clock[0] = 1.5
    assert beat.tick([0, 1]) == []          # the first question to each goes now
    assert beat.next_at == pytest.approx(1.75)
    silent, at = run_until_silent(beat, clock, [0, 1], 10.0)
    assert silent == [1] and at == pytest.approx(1.75)
