"""The step-time planner: which candidates it lists, how its terms move with bytes and codecs, what it recommends."""

import json
import math
import re
from pathlib import Path

import pytest
from torch import nn

from elastic_trainer.cli.commands import main
from elastic_trainer.planning import cost_model
from elastic_trainer.comm.compression import CODECS
from elastic_trainer.planning.constants import DEFAULT_OPTIMIZER_S_PER_PARAM, load_constants
from elastic_trainer.planning.planner import predict_candidates, recommend
from elastic_trainer.planning.sync_cost import dp_sync_cost
from elastic_trainer.config import TrainerConfig
from elastic_trainer.errors import ConfigError
from elastic_trainer.models.gpt import TokenCrossEntropy

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "jobs" / "demo.yaml"
A, B = 100e-6, 1e-9  # 100 us, 1 GB/s


def demo(*overrides: str) -> TrainerConfig:
    return TrainerConfig.from_yaml(DEMO, list(overrides))


def consts(alpha: float = A, beta: float = B, **extra) -> dict:
    table = {name: {"alpha_s": alpha, "beta_s_per_byte": beta} for name in ("ring", "tree", "chunked")}
    return {"algorithms": {**table, **extra}}


def pick(rows, dp, pp, compression="none", sync="allreduce"):
    [row] = [r for r in rows if (r["dp"], r["pp"], r["compression"], r["sync"]) == (dp, pp, compression, sync)]
    return row


def test_candidates_cover_every_feasible_layout_with_every_codec_and_sync():
    rows = predict_candidates(demo(), 4, consts())
    # The demo: 6 blocks, global batch 16 of micro-batches of 4, so dp in {1, 2, 4} with dp * pp <= 4.
    layouts = {(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 3), (1, 4)}
    assert {(r["dp"], r["pp"]) for r in rows} == layouts
    for dp, pp in layouts:
        got = sorted((r["compression"], r["sync"]) for r in rows if (r["dp"], r["pp"]) == (dp, pp))
        want = [("none", "allreduce"), ("none", "parameter_server")]
        if dp > 1:
            want += [(c, "allreduce") for c in CODECS if c != "none"]
            want += [(c, s) for c in ("none", "fp16", "bf16") for s in ("local_sgd", "diloco")]
        assert got == sorted(want), (dp, pp)
    assert [(r["dp"], r["pp"], r["compression"], r["sync"]) for r in rows if r["configured"]] == [
        (2, 2, "none", "allreduce")]
    assert [r["total_s"] for r in rows] == sorted(r["total_s"] for r in rows)
    assert all(r["world_size"] <= 4 for r in rows)


def test_more_gradient_bytes_predict_more_comm():
    small = predict_candidates(demo(), 4, consts())
    big = predict_candidates(demo("model.d_model=256"), 4, consts())
    for name in CODECS:
        s, b = pick(small, 4, 1, name), pick(big, 4, 1, name)
        assert b["comm_bytes"] > s["comm_bytes"] and b["dp_comm_s"] > s["dp_comm_s"], name
    cfg = demo()
    times = [dp_sync_cost(cfg, "none", [(n,)], 4, {"ring": (A, B)}, algorithm="ring")[0] for n in (1, 10**3, 10**6)]
    assert times == sorted(times) and times[0] < times[-1]


def test_int8_and_topk_are_priced_at_the_exchanges_they_send_where_those_were_timed():
    # A backend whose all-gather runs at a third of the ring's pace (as gloo's did on a capped lab link).
    slow = {"allgather": {"alpha_s": 3 * A, "beta_s_per_byte": 3 * B}}
    base = predict_candidates(demo(), 4, consts())
    timed = predict_candidates(demo(), 4, consts(**slow))
    for name in ("none", "fp16", "powersgd"):   # all-reduces: the ring's constants, as before
        assert pick(timed, 4, 1, name)["dp_comm_s"] == pytest.approx(pick(base, 4, 1, name)["dp_comm_s"]), name
    # top-k sends only an all-gather: three times the time; int8 half of its bytes: twice.
    assert pick(timed, 4, 1, "topk")["dp_comm_s"] == pytest.approx(3 * pick(base, 4, 1, "topk")["dp_comm_s"])
    assert pick(timed, 4, 1, "int8")["dp_comm_s"] == pytest.approx(2 * pick(base, 4, 1, "int8")["dp_comm_s"])


def test_compression_lowers_comm_by_the_byte_ratio():
    # Without latency every codec's wire time is its bytes times beta.
    rows = predict_candidates(demo(), 4, consts(alpha=0.0))
    none = pick(rows, 4, 1)
    assert none["dp_comm_s"] == pytest.approx(none["comm_bytes"] * B)
    assert pick(rows, 4, 1, "fp16")["dp_comm_s"] == pytest.approx(none["dp_comm_s"] / 2)
    for name in CODECS:
        r = pick(rows, 4, 1, name)
        assert r["dp_comm_s"] / none["dp_comm_s"] == pytest.approx(r["comm_bytes"] / none["comm_bytes"]), name
        assert r["comm_bytes"] <= none["comm_bytes"], name
    # fp16 and bf16 are all-reduces too: they run the configured algorithm at half the bytes.
    tree = predict_candidates(demo("comm.algorithm=tree"), 4, consts(alpha=0.0))
    assert pick(tree, 4, 1, "fp16")["algorithm"] == "tree" and pick(tree, 4, 1, "int8")["algorithm"] == "backend"
    assert pick(tree, 4, 1, "bf16")["dp_comm_s"] == pytest.approx(pick(tree, 4, 1)["dp_comm_s"] / 2)
    # With latency, each codec pays its collectives' sequential steps: one bucket, p = 4.
    rows = predict_candidates(demo(), 4, consts())
    steps = {"none": 6, "fp16": 6, "bf16": 6, "int8": 6, "topk": 3, "powersgd": 12}
    for name, n in steps.items():
        r = pick(rows, 4, 1, name)
        assert r["dp_comm_s"] == pytest.approx(n * A + r["comm_bytes"] * B), name


def test_local_sgd_diloco_and_parameter_server_terms():
    rows = predict_candidates(demo("comm.local_steps=4", "comm.ps_shards=2"), 4, consts())
    ring = pick(rows, 4, 1)
    for sync in ("local_sgd", "diloco"):
        assert pick(rows, 4, 1, sync=sync)["dp_comm_s"] == pytest.approx(ring["dp_comm_s"] / 4)
    # Local SGD's meeting is one all-reduce of every parameter, not one per bucket.
    many = demo("comm.local_steps=4", "comm.bucket_mb=0.25")
    local = pick(predict_candidates(many, 4, consts()), 4, 1, sync="local_sgd")
    assert local["dp_comm_s"] == pytest.approx(cost_model.predict("ring", 4 * local["rank_params"], 4, A, B) / 4)
    # A meeting in fp16 sends the change in 2 bytes an element: half the bytes, and its cast's arithmetic.
    for sync in ("local_sgd", "diloco"):
        half = pick(rows, 4, 1, compression="fp16", sync=sync)
        assert half["comm_bytes"] == pytest.approx(pick(rows, 4, 1, sync=sync)["comm_bytes"] / 2, abs=1)
        assert half["dp_comm_s"] == pytest.approx(cost_model.predict("ring", 2 * half["rank_params"], 4, A, B) / 4)
        assert half["codec_s"] > 0
    # Every shard sits on one node: its link is the one server of cost_model's "ps".
    ps = pick(rows, 4, 1, sync="parameter_server")
    n = 4 * ps["rank_params"]
    assert ps["dp_comm_s"] == pytest.approx(cost_model.predict("ps", n, 4, A, B, shards=1))
    assert ps["comm_bytes"] == 2 * n  # push + pull
    # The shards run AdamW on half the parameters each; the workers run none.
    assert ps["compute_s"] == pytest.approx(ring["compute_s"] - ps["rank_params"] * DEFAULT_OPTIMIZER_S_PER_PARAM)
    assert ps["codec_s"] == pytest.approx(math.ceil(ps["rank_params"] / 2) * DEFAULT_OPTIMIZER_S_PER_PARAM)


def test_a_measured_ps_entry_prices_the_parameter_server():
    cfg = demo()
    derived = pick(predict_candidates(cfg, 4, consts()), 4, 1, sync="parameter_server")
    assert "alpha/beta from ring" in derived["notes"]
    measured = consts(ps={"alpha_s": 0.015, "beta_s_per_byte": 1e-9, "derived_from": "Ray echo"})
    ps = pick(predict_candidates(cfg, 4, measured), 4, 1, sync="parameter_server")
    n = 4 * ps["rank_params"]
    assert ps["dp_comm_s"] == pytest.approx(cost_model.predict("ps", n, 4, 0.015, 1e-9, shards=1))
    assert "alpha/beta from Ray echo" in ps["notes"]


def test_compute_follows_the_rate_the_bubble_and_shared_cores():
    cfg = demo()
    base = predict_candidates(cfg, 4, consts(), {"flops_per_s": 1e10, "optimizer_s_per_param": 0.0})
    r = pick(base, 4, 1)
    tokens = 16 // 4 * 128
    assert r["compute_s"] == pytest.approx(6 * r["rank_params"] * tokens / 1e10)
    # A measurement of the same work in the same time gives the same rate.
    meas = predict_candidates(cfg, 4, consts(), {"seconds": 6 * 1000 * 10 / 1e10, "params": 1000, "tokens": 10,
                                                 "optimizer_s_per_param": 0.0})
    assert pick(meas, 4, 1)["compute_s"] == pytest.approx(r["compute_s"])
    # Four workers on two cores run at half the rate.
    shared = predict_candidates(cfg, 4, consts(), {"flops_per_s": 1e10, "optimizer_s_per_param": 0.0, "cpus": 2})
    assert pick(shared, 4, 1)["compute_s"] == pytest.approx(2 * r["compute_s"])
    assert pick(shared, 2, 1)["compute_s"] == pytest.approx(pick(base, 2, 1)["compute_s"])
    # Cores as measured with the workers sharing them: fractional, and the same rule.
    measured = predict_candidates(cfg, 4, consts(), {"flops_per_s": 1e10, "optimizer_s_per_param": 0.0, "cpus": 1.6})
    assert pick(measured, 4, 1)["compute_s"] == pytest.approx(4 / 1.6 * r["compute_s"])
    for bad in (0, -1.0, float("nan"), True, "2"):
        with pytest.raises(ConfigError, match="cpus a number > 0"):
            predict_candidates(cfg, 4, consts(), {"flops_per_s": 1e10, "cpus": bad})
    # A measured per-step overhead is added to every row's compute, the parameter server's too.
    over = predict_candidates(cfg, 4, consts(), {"flops_per_s": 1e10, "optimizer_s_per_param": 0.0,
                                                 "step_overhead_s": 0.02})
    for key in [(4, 1, "none", "allreduce"), (2, 2, "none", "allreduce"), (4, 1, "none", "parameter_server")]:
        a, b = pick(base, *key[:2], *key[2:]), pick(over, *key[:2], *key[2:])
        assert b["compute_s"] == pytest.approx(a["compute_s"] + 0.02)
        assert b["total_s"] == pytest.approx(a["total_s"] + 0.02)
    with pytest.raises(ConfigError, match="step_overhead_s must be a finite number >= 0; got -1.0"):
        predict_candidates(cfg, 4, consts(), {"flops_per_s": 1e10, "step_overhead_s": -1.0})
    # dp=2 x pp=2, 1f1b: two micro-batches, bubble (2 + 1) / 2.
    p = pick(base, 2, 2)
    assert p["bubble"] == pytest.approx(1.5)
    assert p["compute_s"] == pytest.approx(6 * p["rank_params"] * (16 // 2 * 128) / 1e10 * 1.5)
    # One boundary: 4 x 128 x 128 fp32 activations each way, in each of the m + pp - 1 = 3 slots.
    assert p["act_s"] == pytest.approx(2 * 3 * (A + 4 * 128 * 128 * 4 * B))
    assert r["act_s"] == 0.0


def test_overlap_hides_only_buckets_before_the_last():
    cfg = demo("comm.bucket_mb=0.25")
    on = pick(predict_candidates(cfg, 4, consts()), 4, 1)
    off = pick(predict_candidates(demo("comm.bucket_mb=0.25", "comm.overlap=false"), 4, consts()), 4, 1)
    assert off["hidden_s"] == 0.0 and 0 < on["hidden_s"] < on["dp_comm_s"]
    assert on["total_s"] == pytest.approx(off["total_s"] - on["hidden_s"])
    # One bucket: nothing can start before backward ends.
    assert pick(predict_candidates(demo(), 4, consts()), 4, 1)["hidden_s"] == 0.0


def test_recommendation_names_its_time_the_runner_up_and_the_config():
    rows = predict_candidates(demo(), 4, consts())
    best, reason = recommend(rows)
    assert best["total_s"] == min(r["total_s"] for r in rows)
    runner_up = sorted(rows, key=lambda r: r["total_s"])[1]
    configured = next(r for r in rows if r["configured"])
    numbers = [float(x) for x in re.findall(r"(\d+\.\d) ms", reason)]
    for r in (best, runner_up, configured):
        assert round(r["total_s"] * 1e3, 1) in numbers
    assert f"dp={configured['dp']} pp={configured['pp']}" in reason and "config as given" in reason
    assert re.search(r"\d+\.\d\dx the winner's time", reason)


def test_recommendation_when_the_config_is_the_best_or_not_a_candidate():
    # With free communication and fast compute, the best is dp=4: the config (dp=4) wins outright.
    cfg = demo("parallel.dp=4", "parallel.pp=1")
    rows = predict_candidates(cfg, 4, consts(alpha=0.0, beta=0.0))
    best, reason = recommend([r for r in rows if r["sync"] == "allreduce" and r["compression"] == "none"])
    assert best["configured"] and "this is the config as given" in reason
    _, reason = recommend(predict_candidates(cfg, 2, consts()))
    assert "not among these candidates" in reason


def test_bad_inputs_name_what_was_given():
    cfg = demo()
    with pytest.raises(ConfigError, match=r"workers must be an int >= 1; got 0"):
        predict_candidates(cfg, 0)
    with pytest.raises(ConfigError, match=r"no 'ring' entry \(found tree\)"):
        predict_candidates(cfg, 4, {"algorithms": {"tree": {"alpha_s": A, "beta_s_per_byte": B}}})
    with pytest.raises(ConfigError, match=r"'ring' has alpha_s=-1.0"):
        predict_candidates(cfg, 4, consts(alpha=-1.0))
    with pytest.raises(ConfigError, match=r"'ring' needs numeric alpha_s"):
        predict_candidates(cfg, 4, {"algorithms": {"ring": {"alpha": 1}}})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) flops; valid: flops_per_s"):
        predict_candidates(cfg, 4, consts(), {"flops": 1e9})
    with pytest.raises(ConfigError, match=r"needs all of seconds, params and tokens; got only seconds"):
        predict_candidates(cfg, 4, consts(), {"seconds": 1.0})
    with pytest.raises(ConfigError, match=r"'tree' has no constants \(found chunked, ps, ring\)"):
        predict_candidates(demo("comm.algorithm=tree"), 4,
                           {"algorithms": {k: {"alpha_s": A, "beta_s_per_byte": B} for k in ("ring", "chunked")}})
    with pytest.raises(ConfigError, match=r"unknown compression 'zip'"):
        dp_sync_cost(cfg, "zip", [(4, 4)], 2, {"ring": (A, B)})
    with pytest.raises(ConfigError, match=r"no dp x pp fits 1 worker\(s\).*'interleaved' needs pp >= 2"):
        predict_candidates(demo("parallel.schedule=interleaved"), 1)
    with pytest.raises(ConfigError, match="at least one candidate"):
        recommend([])


def test_constants_file_round_trip_and_errors(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**consts(alpha=0.0, beta=1e-6), "compute": {"flops_per_s": 1e12}}))
    doc = load_constants(path)
    assert doc["source"] == str(path)
    slow = pick(predict_candidates(demo(), 4, doc), 4, 1)
    assert slow["dp_comm_s"] == pytest.approx(slow["comm_bytes"] * 1e-6)
    assert main(["plan", str(DEMO), "--workers", "4", "--constants", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["dp"], out["pp"]) == (2, 2)  # the plan as configured, as before
    pred = out["predictions"]
    assert pred["workers"] == 4 and pred["constants"] == str(path)
    # The file's compute rate is used, not the built-in one.
    r = pick(pred["candidates"], 4, 1)
    assert r["compute_source"] == "given flops_per_s"
    assert r["compute_s"] == pytest.approx(6 * r["rank_params"] * 512 / 1e12
                                           + r["rank_params"] * DEFAULT_OPTIMIZER_S_PER_PARAM)
    assert pred["recommended"]["total_s"] == min(r["total_s"] for r in pred["candidates"])
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=r"nope.json' does not exist; write one with `elastic-trainer bench-comm"):
        load_constants(missing)
    (tmp_path / "bad.json").write_text("{")
    assert main(["plan", str(DEMO), "--constants", str(tmp_path / "bad.json")]) == 2
    assert "is not JSON" in capsys.readouterr().err


def test_plan_prints_the_table_the_recommendation_and_the_configured_plan(capsys):
    assert main(["plan", str(DEMO), "--workers", "4"]) == 0
    out = capsys.readouterr().out
    head, _, rest = out.partition("recommended: ")
    assert "compression" in head and "<- as configured" in head
    assert re.search(r"^\s+2\s+2\s+none\s+allreduce\s+ring\s+[\d.]+\s+[\d.]+\s+[\d.]+", head, re.M)
    reason, _, plan = rest.partition("the job as configured:")
    assert "ms/step" in reason
    assert json.loads(plan)["stages"][0]["blocks"] == [0, 3]
    assert main(["plan", str(DEMO), "--workers", "0"]) == 2
    assert "--workers must be >= 1; got 0" in capsys.readouterr().err


class _NeedsRealValues(nn.Module):
    """An embedding that reads a value out of its input: impossible on the meta device."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 8)

    def forward(self, x):
        return self.emb(x.clamp(max=int(x.max().item())))


def build_meta_hostile():
    return [_NeedsRealValues(), nn.Linear(8, 8), nn.Linear(8, 256)], TokenCrossEntropy()


def _factory_cfg(factory: str, **kwargs) -> TrainerConfig:
    return TrainerConfig.model_validate({
        "data": {"path": "x", "seq_len": 8},
        "model": {"factory": factory, "kwargs": kwargs},
        "train": {"global_batch_size": 4, "micro_batch_size": 1},
    })


def test_a_user_models_activations_come_from_a_meta_forward():
    rows = predict_candidates(_factory_cfg("tests.helpers:build_mlp", width=8), 4, consts())
    assert {(r["dp"], r["pp"]) for r in rows} >= {(4, 1), (2, 2), (1, 4)}
    # The MLP's boundary is a (micro_batch, seq_len, width) fp32 tensor; 4 micro-batches, pp = 2.
    r = pick(rows, 1, 2)
    assert r["act_s"] == pytest.approx(2 * (4 + 1) * (A + 1 * 8 * 8 * 4 * B))


def test_a_model_that_cannot_run_on_meta_is_refused_for_pipelines_only():
    cfg = _factory_cfg(f"{__name__}:build_meta_hostile")
    assert {(r["dp"], r["pp"]) for r in predict_candidates(cfg, 1, consts())} == {(1, 1)}
    with pytest.raises(ConfigError, match=r"does not run on the meta device \(RuntimeError: .*\); plan with "
                                          r"--workers 1"):
        predict_candidates(cfg, 2, consts())


def test_plan_shows_memory_and_the_replan_for_the_configured_codec(tmp_path, capsys):
    assert main(["plan", str(DEMO), "--workers", "3"]) == 0
    out = capsys.readouterr().out
    assert "MB/worker" in out
    assert re.search(r"^re-plan after a failure on 3 worker\(s\), keeping compression none and sync allreduce: "
                     r"dp=\d pp=\d, predicted [\d.]+ ms/step, [\d.]+ MB/worker$", out, re.M)
    assert main(["plan", str(DEMO), "--workers", "4", "--json", "--memory-gb", "0.43",
                 "--set", "comm.compression=int8"]) == 0
    shown = json.loads(capsys.readouterr().out)
    pred = shown["predictions"]
    assert pred["worker_memory_bytes"] == 0.43 * (1 << 30)
    # The configured layout's bytes per rank, buffer by buffer; int8 adds its residual beside the buckets.
    ranks = shown["memory_per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["micro_batches_in_flight"] == 2
    for r in ranks:
        assert r["comm_state"] == r["grad_buckets"] == r["weights"] > 0
        assert r["host"] == r["device"] + r["snapshots"] + r["runtime"] == r["bounded"]
        assert r["activations"] == r["micro_batches_in_flight"] * r["activation_per_micro_batch"]
    assert all(r["memory_bytes"] <= pred["worker_memory_bytes"] for r in pred["candidates"])
    replan = pred["replan"]
    assert replan["compression"] == "int8" or replan["dp"] == 1
    assert replan["total_s"] == min(r["total_s"] for r in pred["candidates"]
                                    if r["compression"] == "int8" or r["dp"] == 1 and r["sync"] == "allreduce")
    assert main(["plan", str(DEMO), "--memory-gb", "0"]) == 2
    assert "--memory-gb must be > 0; got 0.0" in capsys.readouterr().err
    assert main(["plan", str(DEMO), "--memory-gb", "0.001"]) == 2
    assert "fits 1.0 MiB per worker; the smallest" in capsys.readouterr().err
    # Without --constants, plan reads the job's comm.constants.
    path = tmp_path / "c.json"
    path.write_text(json.dumps(consts()))
    assert main(["plan", str(DEMO), "--json", "--set", f"comm.constants={path}"]) == 0
    assert json.loads(capsys.readouterr().out)["predictions"]["constants"] == str(path)
