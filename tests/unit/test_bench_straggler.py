"""benchmarks/straggler.py reads the figures behind balance's decisions off a run's events (the
integration tests assert the decisions; the figures, which hold only on a quiet host, are reported here)."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "straggler.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_straggler", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EVENTS = [
    {"kind": "straggler", "rank": 0, "worker": 4, "step": 8, "since_step": 5, "slow_pace": 1.3},   # another worker
    {"kind": "straggler", "rank": 1, "worker": 5, "step": 12, "since_step": 9, "slow_pace": 2.7,
     "compute_s": 0.27, "reference_s": 0.1},
    {"kind": "rebalance", "action": "spare", "rank": 1, "step": 24, "pace": 2.9, "predicted_step_s": 0.05,
     "step_s_before": 0.2, "cost_s": 3.0, "payback_steps": 20.0, "plan_after": {"dp": 1, "pp": 1}},
    {"kind": "rebalance", "action": "readmit", "worker": 5, "rank_before": 1, "step": 40, "benched_steps": 16,
     "probe_s": 0.02, "probe_s_benched": 0.4, "reason": "its probe is faster"},
    {"kind": "straggler_recovered", "rank": 1, "step": 44},
]


def test_the_slowed_workers_decisions_and_their_figures_are_read_in_order():
    bench = _bench()
    got = bench.decisions(EVENTS, worker=5, start=3, end=30)
    assert got["named"] == {"step": 12, "since_step": 9, "steps_after_start": 9, "slow_pace": 2.7,
                            "compute_s": 0.27, "reference_s": 0.1}
    assert got["recovered"] == {"step": 44, "steps_after_end": 14}
    assert got["spare"]["payback_steps"] == 20.0 and got["spare"]["plan_after"] == {"dp": 1, "pp": 1}
    assert got["readmit"]["probe_speedup"] == 20.0 and got["readmit"]["steps_after_end"] == 10
    assert "shares" not in got
    # A worker never named has no decisions; one named before the slowdown's start is not this one.
    assert bench.decisions(EVENTS, worker=7, start=3, end=30) == {}
    assert bench.decisions(EVENTS, worker=5, start=13, end=30) == {}


def test_the_decision_table_counts_the_rounds_that_took_each_and_their_medians():
    bench = _bench()
    one = bench.decisions(EVENTS, worker=5, start=3, end=30)
    runs = [{"mode": "act", "slow": True, "decisions": one}, {"mode": "act", "slow": True, "decisions": {}},
            {"mode": "off", "slow": True}, {"mode": "ray_train", "slow": True, "events": []}]
    table = bench.decision_table(runs)
    assert list(table) == ["act"]
    act = table["act"]
    assert (act["rounds"], act["named_rounds"], act["spare_rounds"], act["readmit_rounds"]) == (2, 1, 1, 1)
    assert act["named.slow_pace"] == {"median": 2.7, "values": [2.7]}
    assert act["readmit.probe_speedup"]["values"] == [20.0]
