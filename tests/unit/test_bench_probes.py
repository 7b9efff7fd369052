"""A benched straggler's probe is read against a running peer's, timed beside it
(controller.benching): load that changes for the whole host lets no slow worker back in."""

from types import SimpleNamespace

import pytest

from elastic_trainer.config import TrainerConfig
from elastic_trainer.controller.balance.benching import Bench, Benched

from ..conftest import tiny_config


class Probed(Bench):
    """Bench with its probes answered from a script: worker id -> seconds, per round."""

    def __init__(self, rounds):
        cfg = TrainerConfig.from_dict(tiny_config("/nonexistent", balance={"window": 2, "threshold": 0.15}))
        super().__init__(cfg, SimpleNamespace(ranks={0: 0}, step=0, name="t"), _Pool({0, 1}))
        self.rounds = iter(rounds)

    def _probe(self, asks):
        if not asks:
            return []
        times = next(self.rounds)
        return [(times[w], n or 64) for w, n in asks]


class _Pool:
    def __init__(self, wids):
        self.workers = {w: None for w in wids}

    def __contains__(self, wid):
        return wid in self.workers


def _benched(rounds):
    bench = Probed(rounds)
    bench.benched[1] = Benched(1, 1, 3.0, 10)
    bench._baseline(list(bench.benched.values()))
    return bench


def test_a_host_that_got_faster_for_everyone_lets_no_slow_worker_back():
    # Baseline: sized alone, then 0.40 s beside the peer's 0.020 s. Later the whole host runs
    # 20% faster (both probes), the worker still 20x slow: against the peer, nothing changed.
    bench = _benched([{1: 0.40}, {1: 0.40, 0: 0.020}, {1: 0.32, 0: 0.016}])
    assert bench.poll(step=20) == [] and 1 in bench.benched


def test_a_worker_that_recovered_is_let_back_in_with_both_probes_in_the_event():
    bench = _benched([{1: 0.40}, {1: 0.40, 0: 0.020}, {1: 0.021, 0: 0.020}])
    [ev] = bench.poll(step=20)
    assert ev["action"] == "readmit" and ev["reason"] == "its probe is faster" and 1 not in bench.benched
    assert (ev["probe_s"], ev["peer_probe_s"], ev["probe_s_benched"], ev["peer_probe_s_benched"]) == (
        0.021, 0.02, 0.4, 0.02)
    assert ev["speedup"] == pytest.approx(0.4 / 0.021, rel=1e-3) and ev["speedup_needed"] == pytest.approx(20 ** 0.5, rel=1e-3)


def test_noise_against_the_peer_lets_no_20x_slow_worker_back():
    # 1.3x faster against the peer (seen beside a busy peer on this shared host) is noise for a
    # worker benched 20x slower: half its slowdown on a log scale is sqrt(20) = 4.5x.
    bench = _benched([{1: 0.40}, {1: 0.40, 0: 0.020}, {1: 0.30, 0: 0.020}])
    assert bench.poll(step=20) == [] and 1 in bench.benched


def test_without_a_running_peer_the_probe_is_read_alone():
    bench = Probed([{1: 0.40}, {1: 0.30}])
    bench.run.ranks = {}   # no running rank to probe beside
    bench.benched[1] = Benched(1, 1, 3.0, 10)
    bench._baseline(list(bench.benched.values()))
    assert bench.benched[1].peer_s is None
    [ev] = bench.poll(step=20)   # 25% faster alone: past the threshold
    assert ev["peer_probe_s"] is None and ev["probe_s"] == 0.3
