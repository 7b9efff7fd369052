"""The p2p all-reduce algorithms and the gradient codecs, on real gloo groups of 2, 3 and 4 processes.

One spawn per group size runs every check and writes what it measured; the
tests below judge those measurements, so one slow start serves them all.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_trainer.comm.algorithms import bytes_sent, chunked_allreduce, get_algorithm, tree_allreduce
from elastic_trainer.comm.stats import CommStats
from elastic_trainer.comm.compression import CODECS, expected_bytes, make_codec
from elastic_trainer.planning.calibration import sweep
from elastic_trainer.worker.process_group import free_port

SIZES = (1, 5, 1000, 4099)
# A bucket with two plain matrices, a conv-like 3-D weight, and vectors between and after them.
SHAPES = [(0, (48, 40)), (1920, (40,)), (1960, (64, 32)), (4008, (32,)), (4040, (16, 4, 10)), (4680, (17,))]
BUCKET = 4697
STEPS = 60
CODEC_RUNS = {
    "none": {}, "fp16": {}, "bf16": {},
    "int8": {"chunk": 256},
    "topk": {"ratio": 0.05},
    "topk16": {"ratio": 0.05, "value_dtype": "float16"},
    "topk_rs": {"ratio": 0.05, "exchange": "sparse_reduce"},
    "topk_rs16": {"ratio": 0.05, "exchange": "sparse_reduce", "value_dtype": "float16"},
    # k covers every entry: the dense average.
    "topk_rs_full": {"ratio": 1.0, "exchange": "sparse_reduce"},
    "powersgd": {"rank": 2, "start_step": 3},
}
# Runs of one codec under other options.
CODEC_OF = {"topk16": "topk", "topk_rs": "topk", "topk_rs16": "topk", "topk_rs_full": "topk"}
GPT_CODECS = {"none": {}, "fp16": {}, "bf16": {}, "int8": {}, "topk": {"ratio": 0.01}, "powersgd": {"rank": 4}}


def _codec(run: str, **extra):
    return make_codec(CODEC_OF.get(run, run), **CODEC_RUNS.get(run, {}), **extra)


def _grads(rank: int, step: int, base: torch.Tensor) -> torch.Tensor:
    """A shared direction plus per-rank, per-step noise: what data-parallel gradients look like."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return base + torch.randn(base.numel(), generator=gen)


def _check_algorithms(rank: int, world: int) -> list[dict]:
    out = []
    # Ranks 1.. as a subgroup: its group ranks are not the global ranks.
    sub = dist.new_group(list(range(1, world))) if world >= 3 else None
    for label, group, members in (("world", None, range(world)), ("sub", sub, range(1, world))):
        if label == "sub" and (sub is None or rank == 0):
            continue
        p, grank = len(members), dist.get_rank(group)
        for n in SIZES:
            for name, fn, kw in (("tree", tree_allreduce, {}), ("chunked", chunked_allreduce, {"chunk_bytes": 64}),
                                 ("chunked", chunked_allreduce, {})):
                gen = torch.Generator().manual_seed(100 * rank + n)
                ints = torch.randint(-1000, 1000, (n,), generator=gen).float()
                reals = torch.randn(n, generator=gen)
                # A strided view: the algorithm must write its sum back through it.
                holder = torch.zeros(n, 2)
                holder[:, 0] = reals
                ref_i, ref_r = ints.clone(), reals.clone()
                dist.all_reduce(ref_i, group=group)
                dist.all_reduce(ref_r, group=group)
                stats = CommStats()
                fn(ints, group, stats, **kw)
                counted = stats.bytes
                fn(holder[:, 0], group, None, **kw)
                out.append({
                    "group": label, "alg": name, "n": n, "p": p, "kw": kw,
                    "exact": bool(torch.equal(ints, ref_i)),
                    "rel_err": float((holder[:, 0] - ref_r).abs().max() / ref_r.abs().max().clamp_min(1e-30)),
                    "bytes": counted, "expected": bytes_sent(name, n, p, grank, **kw),
                })
    return out


def _check_codecs(rank: int, world: int) -> dict:
    base = torch.randn(BUCKET, generator=torch.Generator().manual_seed(7))
    singles = [dist.new_group([r]) for r in range(world)]
    out = {}
    for run in list(CODEC_RUNS) + ["topk_no_ef", "topk_rs_no_ef", "powersgd_no_ef"]:
        name = run.replace("_no_ef", "")
        codec = _codec(name, **({"error_feedback": False} if run.endswith("no_ef") else {}))
        opts = dict(CODEC_RUNS[name])
        cum_d = torch.zeros(BUCKET, dtype=torch.float64)
        cum_a = torch.zeros(BUCKET, dtype=torch.float64)
        rec = {"bytes": [], "expected": [], "step_err": [], "sum_err": []}
        for step in range(STEPS):
            true = torch.stack([_grads(r, step, base) for r in range(world)]).double().mean(0)
            flat = _grads(rank, step, base)
            stats = CommStats()
            codec.average(flat, None, stats, shapes=SHAPES)
            rec["bytes"].append(stats.bytes)
            rec["expected"].append(expected_bytes(CODEC_OF.get(name, name), BUCKET, world, SHAPES,
                                                  **opts, **({"step": step} if name == "powersgd" else {})))
            rec["step_err"].append(float((flat.double() - true).norm() / true.norm()))
            cum_d += flat.double()
            cum_a += true
            rec["sum_err"].append(float((cum_d - cum_a).norm() / cum_a.norm()))
            if step == 0:
                rec["first_max_err"] = float((flat.double() - true).abs().max())
                rec["first_bound"] = max(float(_grads(r, 0, base).abs().max()) for r in range(world)) / 127
        residual = codec.state_dict().get("residual.0", torch.zeros(BUCKET)).double()
        dist.all_reduce(residual)
        rec["identity_err"] = float((cum_d + residual / world - cum_a).norm() / cum_a.norm())
        # A restored copy must carry on exactly where the original would.
        twin = _codec(name, **({"error_feedback": False} if run.endswith("no_ef") else {}))
        twin.load_state_dict(codec.state_dict())
        z = _grads(rank, STEPS, base)
        z1, z2 = z.clone(), z.clone()
        codec.average(z1, None, None, shapes=SHAPES)
        twin.average(z2, None, None, shapes=SHAPES)
        rec["twin_equal"] = bool(torch.equal(z1, z2))
        rec["state_keys"] = sorted(codec.state_dict())
        # Alone in a group the average is exact: whatever was still owed is paid now.
        owed = codec.state_dict().get("residual.0", torch.zeros(BUCKET))
        alone = z.clone()
        codec.average(alone, singles[rank], None, shapes=SHAPES)
        rec["alone_err"] = float((alone - z - owed).abs().max() / (z + owed).abs().max())
        rec["alone_residual_left"] = float(codec.state_dict().get("residual.0", torch.zeros(1)).abs().max())
        out[run] = rec
    return out


def _check_gpt_ratios(rank: int, world: int) -> dict:
    from elastic_trainer.models.gpt import build_gpt

    blocks, _ = build_gpt(n_layer=4, n_head=4, d_model=128, seq_len=128, vocab_size=256)
    shapes, offset = [], 0
    for block in blocks:
        for param in block.parameters():
            shapes.append((offset, tuple(param.shape)))
            offset += param.numel()
    grads = torch.randn(offset, generator=torch.Generator().manual_seed(rank))
    out = {"numel": offset}
    for name, opts in GPT_CODECS.items():
        stats = CommStats()
        make_codec(name, **opts).average(grads.clone(), None, stats, shapes=shapes)
        out[name] = {"bytes": stats.bytes, "expected": expected_bytes(name, offset, world, shapes, **opts)}
    return out


def _written() -> int | None:
    """Bytes this process has handed to write-like syscalls, sockets included (Linux only)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar"))
    except (OSError, StopIteration):
        return None


def _check_wire_bytes(rank: int, world: int) -> list[dict]:
    """Counted bytes against what the process really wrote while the collective ran."""
    if _written() is None:
        return []
    n, shapes = 256 * 256 + 256, [(0, (256, 256)), (256 * 256, (256,))]
    calls = [(name, lambda s, fn=get_algorithm(name): fn(torch.randn(n), None, s))
             for name in ("ring", "tree", "chunked")]
    for name, opts in GPT_CODECS.items():
        codec = make_codec(name, **opts)
        calls.append((name, lambda s, c=codec: c.average(torch.randn(n), None, s, shapes=shapes)))
    out = []
    for name, call in calls:
        stats = CommStats()
        dist.barrier()
        before = _written()
        call(stats)  # a collective returns only after its sends are done
        out.append({"name": name, "counted": stats.bytes, "written": _written() - before, "calls": stats.calls})
    return out


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        t0 = time.perf_counter()
        result = {"algorithms": _check_algorithms(rank, world), "codecs": _check_codecs(rank, world)}
        if world == 2:
            result["gpt"] = _check_gpt_ratios(rank, world)
        result["wire"] = _check_wire_bytes(rank, world)
        result["sweep"] = sweep(None, sizes=[1024, 4096], iters=2, warmup=1)
        result["seconds"] = time.perf_counter() - t0
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


_RUNS: dict[int, list[dict] | BaseException] = {}


def _run(world: int, deadline_s: float = 120.0) -> list[dict]:
    """Every rank's measurements for a group of ``world`` processes (spawned once per size, failures too)."""
    if world not in _RUNS:
        try:
            _RUNS[world] = _spawn(world, deadline_s)
        except BaseException as e:
            _RUNS[world] = e
    if isinstance(_RUNS[world], BaseException):
        raise _RUNS[world]
    return _RUNS[world]


def _spawn(world: int, deadline_s: float, target=None) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(target or _worker, args=(world, free_port("127.0.0.1"), out_dir), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + deadline_s
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise TimeoutError(f"{world} ranks did not finish within {deadline_s}s")
        results = []
        for r in range(world):
            with open(os.path.join(out_dir, f"{r}.json")) as f:
                results.append(json.load(f))
        return results


WORLDS = pytest.mark.parametrize("world", [2, 3, 4])


@WORLDS
def test_tree_and_chunked_sum_like_all_reduce(world):
    for rank, res in enumerate(_run(world)):
        for r in res["algorithms"]:
            assert r["exact"], f"rank {rank}: {r['alg']} {r['kw']} over {r['group']} gave other integer sums"
            assert r["rel_err"] < 1e-6, f"rank {rank}: {r}"
        groups = {r["group"] for r in res["algorithms"]}
        assert groups == ({"world", "sub"} if world >= 3 and rank > 0 else {"world"})


@WORLDS
def test_algorithms_count_the_bytes_they_send(world):
    for rank, res in enumerate(_run(world)):
        for r in res["algorithms"]:
            assert r["bytes"] == r["expected"], f"rank {rank}: {r}"
            # Divisible sizes have the closed form: the ring's 2(p-1)/p, and for a power of two, the tree's too.
            p, n = r["p"], r["n"]
            if n % p == 0 and (r["alg"] == "chunked" or p & (p - 1) == 0):
                assert r["bytes"] == 2 * (p - 1) * n * 4 // p
    # At p = 3 the folded pair works harder: rank 0 hands over N, rank 1 also hands the result back.
    if world == 3:
        tree = [[r["bytes"] for r in res["algorithms"] if (r["alg"], r["group"], r["n"]) == ("tree", "world", 1000)]
                for res in _run(3)]
        assert tree == [[4000], [8000], [4000]]


@WORLDS
def test_counted_bytes_are_the_bytes_written_to_the_sockets(world):
    for rank, res in enumerate(_run(world)):
        if not res["wire"]:
            pytest.skip("no /proc/self/io here to read written bytes from")
        for r in res["wire"]:
            # Message headers are the only thing not counted: gloo's are ~150 bytes a message.
            headers = 1024 * (world - 1) * r["calls"]
            assert r["counted"] <= r["written"] <= 1.02 * r["counted"] + headers, f"rank {rank}: {r}"


@WORLDS
def test_codecs_count_what_expected_bytes_predicts(world):
    for rank, res in enumerate(_run(world)):
        for run, rec in res["codecs"].items():
            assert rec["bytes"] == rec["expected"], f"rank {rank} {run}"
    # PowerSGD sends full fp32 before its start step, then much less.
    psgd = _run(world)[0]["codecs"]["powersgd"]["bytes"]
    assert psgd[0] == psgd[2] == _run(world)[0]["codecs"]["none"]["bytes"][0] > 4 * psgd[3]


@WORLDS
def test_lossless_and_low_precision_averages_are_close(world):
    codecs = _run(world)[0]["codecs"]
    assert max(codecs["none"]["step_err"]) < 1e-6
    assert max(codecs["fp16"]["step_err"]) < 1e-3
    assert max(codecs["bf16"]["step_err"]) < 8e-3
    # Before its start step PowerSGD is a plain all-reduce.
    assert max(codecs["powersgd"]["step_err"][:3]) < 1e-6
    # The sparse reduce with k covering every entry sends and keeps them all: the dense sums.
    assert max(codecs["topk_rs_full"]["step_err"]) < 1e-6
    assert codecs["topk_rs_full"]["identity_err"] < 1e-6


@WORLDS
def test_int8_stays_within_its_scale_error(world):
    rec = _run(world)[0]["codecs"]["int8"]
    # Two roundings (sender, owner), each at most half a step of absmax / 127.
    assert rec["first_max_err"] <= rec["first_bound"]
    assert max(rec["step_err"]) < 0.02


@WORLDS
def test_error_feedback_makes_the_sum_of_averages_converge(world):
    codecs = _run(world)[0]["codecs"]
    half = STEPS // 2 - 1
    for run in ("int8", "topk", "topk16", "topk_rs", "topk_rs16", "powersgd"):
        rec = codecs[run]
        # Exactly what was not delivered is still owed: decoded + mean residual == true, summed over steps.
        assert rec["identity_err"] < 1e-5, run
        # The debt stays bounded while the true sum grows, so the running sum's error falls like 1/steps...
        assert rec["sum_err"][-1] < 0.7 * rec["sum_err"][half], run
        # ...and ends far below the error of any one lossy step.
        assert rec["sum_err"][-1] < 0.25 * min(rec["step_err"][5:]), run
    for run in ("topk", "topk_rs", "powersgd"):
        # Without error feedback the dropped part is gone: the running sum stays as wrong as one step.
        no_ef = codecs[f"{run}_no_ef"]["sum_err"]
        assert no_ef[-1] > 0.8 * no_ef[half] and no_ef[-1] > 0.5, run
        assert codecs[run]["sum_err"][-1] < 0.3 * no_ef[-1], run


@WORLDS
def test_codec_state_restores_into_a_fresh_codec(world):
    for rank, res in enumerate(_run(world)):
        for run, rec in res["codecs"].items():
            assert rec["twin_equal"], f"rank {rank}: restored {run} diverged"
            assert rec["alone_err"] < 1e-6 and rec["alone_residual_left"] == 0.0, f"rank {rank}: {run}"
        assert res["codecs"]["none"]["state_keys"] == []
        assert res["codecs"]["topk"]["state_keys"] == ["residual.0"]
        assert res["codecs"]["topk_no_ef"]["state_keys"] == []
        assert res["codecs"]["topk_rs"]["state_keys"] == ["residual.0"]
        assert res["codecs"]["powersgd"]["state_keys"] == ["q.0", "residual.0", "step.0"]


def test_byte_reduction_on_the_demo_gpt_at_two_ranks():
    gpt = _run(2)[0]["gpt"]
    for res in _run(2):
        for name in GPT_CODECS:
            assert res["gpt"][name]["bytes"] == res["gpt"][name]["expected"], name
    fp32 = gpt["none"]["bytes"]
    assert fp32 == gpt["numel"] * 4  # the ring at p = 2 sends the whole buffer once
    ratio = {name: fp32 / gpt[name]["bytes"] for name in GPT_CODECS}
    print("byte reduction vs fp32:", {k: round(v, 2) for k, v in ratio.items()})
    assert ratio["fp16"] >= 2 and ratio["bf16"] >= 2
    assert ratio["int8"] >= 3.5
    assert ratio["topk"] >= 30
    assert ratio["powersgd"] >= 10


@WORLDS
def test_sweep_rows_report_algbw_and_busbw(world):
    rows = [res["sweep"] for res in _run(world)]
    assert all(r == rows[0] for r in rows), "ranks disagree on the sweep"
    assert [(r["algorithm"], r["size"]) for r in rows[0]] == [
        (a, s) for a in ("ring", "tree", "chunked") for s in (1024, 4096)]
    for r in rows[0]:
        assert r["time_s"] > 0 and r["algbw"] == pytest.approx(r["size"] / r["time_s"])
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * (world - 1) / world)


def test_unknown_codec_and_option_say_what_would_fit():
    with pytest.raises(ValueError) as e:
        make_codec("zstd")
    assert "'zstd'" in str(e.value) and all(name in str(e.value) for name in CODECS)
    with pytest.raises(ValueError, match=r"'topk' takes options \(ratio, value_dtype, error_feedback, warmup_steps, "
                                         r"exchange\); got unknown rank"):
        make_codec("topk", rank=4)
    with pytest.raises(ValueError, match="exchange must be one of allgather, sparse_reduce; got 'tree'"):
        make_codec("topk", exchange="tree")
    with pytest.raises(ValueError, match="ratio must be in"):
        make_codec("topk", ratio=0)
    with pytest.raises(ValueError, match="needs the bucket's parameter shapes"):
        expected_bytes("powersgd", 1000, 2)
    with pytest.raises(ValueError, match="offset 10 with shape"):
        expected_bytes("powersgd", 100, 2, [(0, (4, 4)), (10, (8, 8))])
    with pytest.raises(ValueError, match="'residual.<bucket>'"):
        make_codec("int8").load_state_dict({"q.0": torch.zeros(3)})
    with pytest.raises(ValueError, match="unknown all-reduce algorithm 'bus'; valid: ring, tree, chunked"):
        get_algorithm("bus")


def test_expected_bytes_closed_forms():
    n = 1 << 20
    assert expected_bytes("none", n, 4) == 2 * 3 * n * 4 // 4
    assert expected_bytes("bf16", n, 4) == 2 * 3 * n * 2 // 4
    # int8: every rank sends p-1 parts of n/p int8 values and their scales, twice.
    assert expected_bytes("int8", n, 4, chunk=1024) == 2 * 3 * (n // 4 + 4 * (n // 4 // 1024))
    assert expected_bytes("topk", n, 4, ratio=0.01) == 3 * math.ceil(0.01 * n) * 8
    assert expected_bytes("topk", n, 4, ratio=0.01, value_dtype="float16") == 3 * math.ceil(0.01 * n) * 6
    shapes = [(0, (512, 1024)), (512 * 1024, (1024,))]
    psgd = expected_bytes("powersgd", 512 * 1024 + 1024, 2, shapes, rank=4)
    assert psgd == (512 * 4 + 1024) * 4 + 1024 * 4 * 4
    assert expected_bytes("powersgd", 512 * 1024 + 1024, 2, shapes, rank=4, start_step=5, step=4) == (
        512 * 1024 + 1024) * 4
    assert expected_bytes("int8", n, 1) == 0


def test_topk_warmup_sends_a_falling_share_then_the_ratio():
    codec = make_codec("topk", ratio=0.01, warmup_steps=30)
    shares = [codec.ratio_at(s) for s in range(1, 32)]
    assert shares[0] == pytest.approx(0.25)
    assert all(a > b for a, b in zip(shares[:30], shares[1:30]))
    assert shares[29] > 0.01 and shares[30] == 0.01
    assert codec.ratio_at(None) == 0.01 and make_codec("topk", ratio=0.01).ratio_at(1) == 0.01
    n = 1 << 20
    assert expected_bytes("topk", n, 2, ratio=0.01, warmup_steps=30, step=1) == math.ceil(0.25 * n) * 8
    assert expected_bytes("topk", n, 2, ratio=0.01, warmup_steps=30) == math.ceil(0.01 * n) * 8
    with pytest.raises(ValueError, match="warmup_steps must be >= 0; got -1"):
        make_codec("topk", warmup_steps=-1)


def _sparse_bytes_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Bytes each rank counts for both top-k exchanges on the demo GPT's gradients, in one bucket."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        grads = torch.randn(GPT_NUMEL, generator=torch.Generator().manual_seed(rank))
        out = {}
        for exchange in ("allgather", "sparse_reduce"):
            codec, stats = make_codec("topk", ratio=0.01, exchange=exchange), CommStats()
            codec.average(grads.clone(), None, stats)
            out[exchange] = {"bytes": stats.bytes, "expected": expected_bytes("topk", GPT_NUMEL, world, ratio=0.01,
                                                                             exchange=exchange)}
        # Fewer entries than ranks (some ranges empty), k covering them all: the dense average.
        tiny = torch.randn(3, generator=gen_tiny(rank))
        dense = tiny.clone()
        dist.all_reduce(dense)
        make_codec("topk", ratio=1.0, exchange="sparse_reduce").average(tiny, None, None)
        out["tiny_err"] = float((tiny - dense / world).abs().max())
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def gen_tiny(rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(50 + rank)


# The demo GPT's parameter count (jobs/demo.yaml: 4 layers, d_model 128, vocab 256, seq 128).
GPT_NUMEL = 875_264


def test_sparse_reduce_topk_bytes_per_rank_stay_flat_in_dp():
    counted = {}
    for world in (2, 4, 8):
        ranks = _spawn(world, 120.0, _sparse_bytes_worker)
        assert all(r["tiny_err"] < 1e-6 for r in ranks), (world, [r["tiny_err"] for r in ranks])
        for exchange in ("allgather", "sparse_reduce"):
            # expected_bytes is the busiest rank's count.
            assert max(r[exchange]["bytes"] for r in ranks) == ranks[0][exchange]["expected"], (world, exchange)
        counted[world] = {ex: max(r[ex]["bytes"] for r in ranks) for ex in ("allgather", "sparse_reduce")}
    sparse = [counted[w]["sparse_reduce"] for w in (2, 4, 8)]
    # About 2k index-value pairs at any dp: within 10% of each other...
    assert max(sparse) <= 1.1 * min(sparse), counted
    k = math.ceil(0.01 * GPT_NUMEL)
    assert all(2 * k * 8 <= b <= 2.05 * k * 8 for b in sparse), counted
    # ...where the all-gather's grow as (dp - 1) k.
    assert [counted[w]["allgather"] for w in (2, 4, 8)] == [(w - 1) * k * 8 for w in (2, 4, 8)]
    assert counted[8]["sparse_reduce"] * 3 < counted[8]["allgather"]
