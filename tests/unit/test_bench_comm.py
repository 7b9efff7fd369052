"""bench-comm: the multi-process sweep, the fit of its rows, the loopback limit, and the CLI around them."""

import json

import pytest

from elastic_trainer.cli.commands import main
from elastic_trainer.planning import calibration as bench, cost_model
from elastic_trainer.planning.constants import load_constants
from elastic_trainer.planning.planner import predict_candidates
from elastic_trainer.config import TrainerConfig

SIZES = cost_model.size_range(1 << 10, 64 << 10)  # 1 KiB .. 64 KiB


def _check_rows(rows, p, algorithms, sizes):
    assert [(r["algorithm"], r["size"]) for r in rows] == [(a, s) for a in algorithms for s in sizes]
    for r in rows:
        assert r["p"] == p and r["count"] * 4 == r["size"] and r["time_s"] > 0
        assert r["algbw"] == pytest.approx(r["size"] / r["time_s"], rel=1e-9)
        factor = (p - 1) / p * (1 if r["algorithm"] in ("allgather", "alltoall") else 2)
        assert r["busbw"] == pytest.approx(r["algbw"] * factor, rel=1e-9)


def test_busbw_factor_on_three_processes():
    # p = 3 is where busbw and algbw differ (2(p-1)/p = 4/3); p = 2 cannot tell them apart.
    rows = bench.run_sweep(3, [1024, 8192], ("ring",), iters=1, timeout_s=60)
    _check_rows(rows, 3, ("ring",), [1024, 8192])
    assert all(r["busbw"] == pytest.approx(r["algbw"] * 4 / 3) for r in rows)


def test_fit_constants_recovers_the_model_behind_exact_rows():
    rows = _exact_rows()
    fits = bench.fit_constants(rows)
    assert set(fits) == {"ring", "tree", "allgather", "ps"} and fits["ps"]["derived_from"] == "ring"
    for name in ("ring", "tree", "allgather"):
        assert fits[name]["alpha_s"] == pytest.approx(50e-6, rel=1e-6)
        assert fits[name]["bandwidth_Bps"] == pytest.approx(2e9, rel=1e-6)
        assert fits[name]["relative_residual"] < 1e-9
    with pytest.raises(ValueError, match=r"rows of 'ring' mix rank counts \[2, 4\]"):
        bench.fit_constants(rows + [{**rows[0], "p": 2}])


def test_bad_sweep_arguments_name_what_was_given():
    with pytest.raises(ValueError, match="procs >= 2 .* got procs=1"):
        bench.run_sweep(1, SIZES, ("ring",))
    with pytest.raises(ValueError, match=r"subset of ring, tree, chunked, allgather, alltoall; got \['butterfly'\]"):
        bench.run_sweep(2, SIZES, ("butterfly",))
    with pytest.raises(ValueError, match=r">= 4 bytes .* got \[2\]"):
        bench.run_sweep(2, [2], ("ring",))


def test_parse_size():
    assert [bench.parse_size(s) for s in ("4096", "1KiB", "64K", "256MiB", "1g", "1.5M", 7)] == [
        4096, 1024, 64 << 10, 256 << 20, 1 << 30, 3 << 19, 7]
    with pytest.raises(ValueError, match=r"size '12 parsecs' is not a number of bytes"):
        bench.parse_size("12 parsecs")


def test_loopback_stream_measures_every_repeat_and_keeps_the_best():
    lb = bench.loopback_throughput(16 << 20, repeats=2)
    # Every stream delivered its bytes and was timed; the rate itself is benchmarks/comm.py's
    # figure (its loopback line), which no test bounds: a busy host may take any time.
    assert len(lb["runs_Bps"]) == 2 and all(0 < r < float("inf") for r in lb["runs_Bps"])
    assert lb["bytes_per_s"] == max(lb["runs_Bps"]) and lb["nbytes"] == 16 << 20
    with pytest.raises(ValueError, match="nbytes=10, chunk=1048576"):
        bench.loopback_throughput(10)


def test_cli_json_on_two_processes_parses_and_matches_the_constants_file(tmp_path, capsys):
    out = tmp_path / "constants.json"
    argv = ["bench-comm", "--procs", "2", "--min", "1KiB", "--max", "64KiB", "--iters", "2", "--json",
            "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    swept = ("ring", "tree", "chunked", "allgather", "alltoall")
    _check_rows(doc["rows"], 2, swept, SIZES)
    assert set(doc["algorithms"]) == {*swept, "ps"}
    for name in swept:
        f = doc["algorithms"][name]
        assert f["p"] == 2 and f["samples"] == len(SIZES) and f["relative_residual"] >= 0
        assert set(f) >= {"alpha_s", "beta_s_per_byte", "bandwidth_Bps"}
    ps = doc["algorithms"]["ps"]
    assert ps["derived_from"] == "ring" and ps["alpha_s"] == doc["algorithms"]["ring"]["alpha_s"]
    assert doc["loopback_Bps"] > 0 and doc["loopback"]["bytes_per_s"] == doc["loopback_Bps"]
    assert doc["peak_busbw_Bps"]["ring"] == max(r["busbw"] for r in doc["rows"] if r["algorithm"] == "ring")
    assert ("--procs 2 --min 1KiB --max 64KiB --algorithms ring,tree,chunked,allgather,alltoall --iters 2"
            in doc["command"])
    saved = json.loads(out.read_text())
    assert saved["algorithms"] == doc["algorithms"] and saved["procs"] == 2 and "rows" not in saved


def _exact_rows(a=50e-6, b=1 / 2e9, p=4):
    rows = []
    for name in ("ring", "tree", "allgather"):
        for size in cost_model.size_range(1 << 10, 1 << 24, 4):
            t = cost_model.predict(name, size, p, a, b)
            rows.append({"algorithm": name, "size": size, "count": size // 4, "p": p, "time_s": t,
                         "algbw": size / t, "busbw": size / t * 2 * (p - 1) / p})
    return rows


def test_a_constants_document_feeds_the_planner(tmp_path):
    rows = _exact_rows()
    doc = bench.constants_document(rows, bench.fit_constants(rows), {"bytes_per_s": 4e9}, procs=4, backend="gloo",
                                   command="elastic-trainer bench-comm --procs 4")
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    saved = load_constants(path)
    cfg = TrainerConfig.model_validate({"data": {"path": "x", "seq_len": 16},
                                        "model": {"n_layer": 2, "n_head": 2, "d_model": 16}})
    rows = predict_candidates(cfg, 2, saved)
    assert rows and all(r["constants_source"] == str(path) for r in rows)
    r = next(r for r in rows if (r["dp"], r["compression"], r["sync"]) == (2, "none", "allreduce"))
    assert r["dp_comm_s"] == pytest.approx(cost_model.predict("ring", r["rank_params"] * 4, 2, 50e-6, 1 / 2e9))


def test_cli_table_warnings_and_errors(monkeypatch, capsys):
    # The table, not the measurement: rows whose tree fit comes out with a negative beta.
    rows = _exact_rows()
    rows = [r if r["algorithm"] == "ring" else {**r, "time_s": 1e-3 - r["size"] * 1e-12} for r in rows]
    monkeypatch.setattr(bench, "run_sweep", lambda procs, sizes, algorithms, iters: rows)
    assert main(["bench-comm", "--procs", "4", "--algorithms", "ring,tree", "--no-loopback"]) == 0
    text = capsys.readouterr().out
    assert "# all_reduce  algorithm: ring  ranks: 4" in text and "alpha(us)" in text
    assert "loopback TCP limit" not in text
    assert "warning: tree's fit has beta < 0" in text and "ring's fit" not in text
    assert main(["bench-comm", "--procs", "2", "--min", "1KiB", "--max", "1KiB"]) == 2
    assert "give one message size; fitting alpha and beta needs at least two" in capsys.readouterr().err
    assert main(["bench-comm", "--min", "lots"]) == 2
    assert "--min 'lots'" in capsys.readouterr().err
