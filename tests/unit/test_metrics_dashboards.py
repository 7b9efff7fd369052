"""The generated dashboard and alert rules name only metrics that are exported, and are up to date."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastic_trainer.metrics import METRICS, prometheus_names
from elastic_trainer.metrics.dashboards import ALERTS_FILE, DASHBOARD_FILE, build_alerts, build_dashboard, render

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_dashboards.py"
# A series name: matched whole, so ..._step never matches inside ..._step_time_s.
SERIES = re.compile(r"\bray_elastic_trainer_\w+")


def _panels() -> list[dict]:
    return [p for p in build_dashboard()["panels"] if p["type"] != "row"]


def _exprs(panel: dict) -> list[str]:
    return [t["expr"] for t in panel["targets"]]


def _rules() -> list[dict]:
    return [r for g in build_alerts()["groups"] for r in g["rules"]]


def test_every_panel_queries_only_exported_series():
    exported = set(prometheus_names())
    for panel in _panels():
        assert panel["targets"], panel["title"]
        for expr in _exprs(panel):
            named = set(SERIES.findall(expr))
            assert named, f"panel {panel['title']!r} names no trainer metric: {expr}"
            assert named <= exported, f"panel {panel['title']!r} names {named - exported}, not exported"


def test_every_query_filters_by_the_run_variable():
    for panel in _panels():
        for expr in _exprs(panel):
            selectors = re.findall(r"\bray_elastic_trainer_\w+(\{[^}]*\})?", expr)
            assert selectors and all('run=~"$run"' in s for s in selectors), expr


def test_every_metric_has_a_panel():
    shown = {name for panel in _panels() for expr in _exprs(panel) for name in SERIES.findall(expr)}
    missing = [m.name for m in METRICS if not shown & set(m.series)]
    assert not missing, f"metrics with no panel: {missing}"


def test_dashboard_has_a_run_variable_rows_and_unique_ids():
    dash = build_dashboard()
    run = next(v for v in dash["templating"]["list"] if v["name"] == "run")
    m = re.fullmatch(r"label_values\((\w+), run\)", run["query"]["query"])
    assert m and m.group(1) in prometheus_names()
    assert run["multi"] and run["includeAll"]
    assert [p["title"] for p in dash["panels"] if p["type"] == "row"] == [
        "Progress", "Goodput: where the wall time went", "Throughput", "Communication", "Elasticity and failures",
        "Checkpoints"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in _panels()}
    assert units["step time"] == "s" and units["comm bytes per step"] == "bytes"
    assert units["share of step time communicating"] == "percentunit"


def test_alert_rules_reference_exported_series():
    exported = set(prometheus_names())
    rules = _rules()
    assert {r["alert"] for r in rules} >= {"ElasticTrainerNoProgress", "ElasticTrainerFailuresRepeating"}
    for rule in rules:
        named = set(SERIES.findall(rule["expr"]))
        assert named and named <= exported, (rule["alert"], named - exported)
        assert "run" in rule["expr"] and rule["labels"]["severity"] in ("warning", "critical")


def test_generated_files_are_up_to_date():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    on_disk = {name: (ROOT / "dashboards" / name).read_text() for name in (DASHBOARD_FILE, ALERTS_FILE)}
    assert on_disk == render()
    json.loads(on_disk[DASHBOARD_FILE])
    assert yaml.safe_load(on_disk[ALERTS_FILE]) == build_alerts()


def test_check_fails_on_a_stale_file_and_writing_is_repeatable(tmp_path):
    def gen(*args):
        return subprocess.run([sys.executable, str(SCRIPT), "--out-dir", str(tmp_path), *args],
                              capture_output=True, text=True)

    assert gen("--check").returncode == 1          # nothing written yet
    assert gen().returncode == 0
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert gen().returncode == 0
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == first
    assert gen("--check").returncode == 0
    (tmp_path / ALERTS_FILE).write_text(first[ALERTS_FILE].decode().replace("> 3", "> 30"))
    stale = gen("--check")
    assert stale.returncode == 1 and ALERTS_FILE in stale.stderr


PROMTOOL = shutil.which("promtool")
# In CI scripts/test.sh installs it, so there a missing promtool is a failure, not a skip.
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None and os.environ.get("CI") != "true",
    reason="promtool not on PATH (Debian: apt-get install -y --no-install-recommends prometheus)")


@needs_promtool
def test_promtool_accepts_the_rules():
    proc = subprocess.run([PROMTOOL, "check", "rules", str(ROOT / "dashboards" / ALERTS_FILE)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_promtool
def test_promtool_parses_every_panel_query(tmp_path):
    """Each panel query, with Grafana's variables filled in, as a recording rule: promtool parses it."""
    rules = []
    for panel in _panels():
        for i, expr in enumerate(_exprs(panel)):
            rules.append({"record": f"panel_{panel['id']}_{i}", "expr": expr.replace("$run", ".*")})
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    proc = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _expected(alert: str, run: str, value: str = "") -> dict:
    rule = next(r for r in _rules() if r["alert"] == alert)
    notes = {k: v.replace("{{ $labels.run }}", run).replace("{{ $value }}", value)
             for k, v in rule["annotations"].items()}
    return {"exp_labels": {**rule["labels"], "run": run}, "exp_annotations": notes}


@needs_promtool
def test_alerts_fire_when_they_should_and_not_otherwise(tmp_path):
    """Synthetic series, one sample a minute, through promtool's rule evaluator."""
    step, state = "ray_elastic_trainer_step", "ray_elastic_trainer_controller_state"
    fail = "ray_elastic_trainer_failures_total"
    series = [
        # "stuck": five steps, then none while RUNNING.
        (f'{step}{{run="stuck",WorkerId="w1"}}', "0+1x5 5x40"),
        (f'{state}{{run="stuck",state="RUNNING",WorkerId="w1"}}', "1x45"),
        # "done": finished after ten steps; its series went stale with the controller.
        (f'{step}{{run="done",WorkerId="w2"}}', "0+1x10 stale"),
        (f'{state}{{run="done",state="RUNNING",WorkerId="w2"}}', "1x10 stale"),
        # "young": started at minute 15, its first step still running.
        (f'{step}{{run="young",WorkerId="w3"}}', "_x15 1x30"),
        (f'{state}{{run="young",state="RUNNING",WorkerId="w3"}}', "_x15 1x30"),
        # "burst": four failures in four minutes, the first of them creating the series.
        (f'{fail}{{run="burst",kind="death",WorkerId="w4"}}', "_ 1 2 3 4x40"),
        # "slow": four failures over an hour.
        (f'{fail}{{run="slow",kind="death",WorkerId="w5"}}', "1x15 2x15 3x15 4x15"),
        # "recovering": from minute 3 never leaves RECOVERING; "recovered" leaves it after five minutes.
        (f'{state}{{run="recovering",state="RECOVERING",WorkerId="w6"}}', "0x3 1x30"),
        (f'{state}{{run="recovered",state="RECOVERING",WorkerId="w7"}}', "0x3 1x5 0x25"),
    ]
    tests = [
        ("ElasticTrainerNoProgress", "14m", []),
        ("ElasticTrainerNoProgress", "20m", [_expected("ElasticTrainerNoProgress", "stuck")]),
        ("ElasticTrainerNoProgress", "24m", [_expected("ElasticTrainerNoProgress", "stuck")]),
        # By now "young" has gone 25 minutes without a step, too.
        ("ElasticTrainerNoProgress", "40m", [_expected("ElasticTrainerNoProgress", "stuck"),
                                             _expected("ElasticTrainerNoProgress", "young")]),
        ("ElasticTrainerFailuresRepeating", "6m", [_expected("ElasticTrainerFailuresRepeating", "burst", "4")]),
        ("ElasticTrainerFailuresRepeating", "20m", []),
        ("ElasticTrainerFailuresRepeating", "55m", []),
        ("ElasticTrainerRecoveryStuck", "6m", []),
        ("ElasticTrainerRecoveryStuck", "15m", [_expected("ElasticTrainerRecoveryStuck", "recovering")]),
    ]
    spec = {
        "rule_files": [str(ROOT / "dashboards" / ALERTS_FILE)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in series],
            "alert_rule_test": [{"eval_time": t, "alertname": a, "exp_alerts": e} for a, t, e in tests],
        }],
    }
    path = tmp_path / "alerts_test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    proc = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
