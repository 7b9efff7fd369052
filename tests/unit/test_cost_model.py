"""The alpha-beta model's formulas, and that fit() recovers the alpha and beta that made the data."""

import math
import random

import pytest

from elastic_trainer.planning.calibration import format_table
from elastic_trainer.planning.cost_model import MODELS, fit, predict, size_range

A, B = 25e-6, 1 / 5e9  # 25 us latency, 5 GB/s
MB = 1 << 20


def test_ring_is_2_p_minus_1_latencies_and_2_p_minus_1_over_p_of_the_bytes():
    assert predict("ring", 8 * MB, 4, A, B) == pytest.approx(6 * A + 1.5 * 8 * MB * B)
    assert predict("ring", 8 * MB, 2, A, B) == pytest.approx(2 * A + 8 * MB * B)
    assert predict("ring", 8 * MB, 1, A, B) == 0.0


def test_tree_pays_log_latencies_and_folds_a_non_power_of_two():
    # p = 8: 2 * 3 latencies, same bytes as the ring.
    assert predict("tree", MB, 8, A, B) == pytest.approx(6 * A + 2 * 7 / 8 * MB * B)
    # p = 6: a 4-rank halving-doubling plus the fold in and out.
    assert predict("tree", MB, 6, A, B) == pytest.approx((4 + 2) * A + (2 * 3 / 4 + 2) * MB * B)
    # Small messages: tree beats ring once p is large; big ones at p = 6: the fold costs bytes.
    assert predict("tree", 1024, 16, A, B) < predict("ring", 1024, 16, A, B)
    assert predict("tree", 64 * MB, 6, A, B) > predict("ring", 64 * MB, 6, A, B)


def test_chunked_adds_pipeline_latency_and_hides_the_reduction():
    assert predict("chunked", MB, 4, A, B, chunk_bytes=MB) == pytest.approx(predict("ring", MB, 4, A, B))
    # 64 MiB over 4 ranks: 16 MiB segments, 16 chunks of 1 MiB each.
    t = predict("chunked", 64 * MB, 4, A, B, chunk_bytes=MB)
    assert t == pytest.approx((6 + 15) * A + 1.5 * 64 * MB * B)
    # With the reduction priced, chunking wins once it hides more than the fill latency costs.
    g = 1 / 2e9
    assert predict("chunked", 64 * MB, 4, A, B, gamma=g, chunk_bytes=MB) == pytest.approx(
        21 * A + 1.5 * 64 * MB * B + 0.75 * 64 * MB * g / 16)
    assert predict("chunked", 64 * MB, 4, A, B, gamma=g, chunk_bytes=MB) < predict("ring", 64 * MB, 4, A, B, gamma=g)
    assert predict("chunked", 4096, 4, A, B, gamma=g, chunk_bytes=256) > predict("ring", 4096, 4, A, B, gamma=g)


def test_parameter_server_bottleneck_is_the_worker_or_the_shard_link():
    # As many shards as workers on separate hosts: each worker's link carries N each way.
    assert predict("ps", MB, 4, A, B) == pytest.approx(2 * A + 2 * MB * B)
    # One shard for 4 workers: the shard's link carries 4 N each way.
    assert predict("ps", MB, 4, A, B, shards=1) == pytest.approx(2 * A + 8 * MB * B)
    # Colocated, one shard per worker: the ring's bytes, two latencies.
    assert predict("ps", MB, 4, A, B, colocated=True) == pytest.approx(2 * A + 1.5 * MB * B)
    with pytest.raises(ValueError, match="shards=8, p=4"):
        predict("ps", MB, 4, A, B, shards=8, colocated=True)


def test_unknown_algorithm_names_itself_and_the_valid_ones():
    with pytest.raises(ValueError) as e:
        predict("butterfly", MB, 4, A, B)
    assert "'butterfly'" in str(e.value) and all(m in str(e.value) for m in MODELS)
    with pytest.raises(ValueError, match="p=0"):
        predict("ring", MB, 0, A, B)


@pytest.mark.parametrize("algorithm,p", [("ring", 2), ("ring", 8), ("tree", 6), ("chunked", 4), ("ps", 4)])
def test_fit_recovers_alpha_and_beta_from_exact_data(algorithm, p):
    sizes = size_range(1 << 10, 256 << 20, 4)
    samples = [(n, predict(algorithm, n, p, A, B)) for n in sizes]
    for relative in (False, True):
        f = fit(samples, algorithm, p, relative=relative)
        assert f.alpha == pytest.approx(A, rel=1e-6) and f.beta == pytest.approx(B, rel=1e-6)
        assert f.residual < 1e-12 and f.bandwidth == pytest.approx(5e9, rel=1e-6)


def test_fit_with_noise_stays_close_and_reports_the_noise():
    rng = random.Random(0)
    sizes = size_range(1 << 10, 64 << 20, 2)
    samples = [(n, predict("ring", n, 4, A, B) * (1 + rng.gauss(0, 0.02))) for n in sizes for _ in range(5)]
    f = fit(samples, "ring", 4, relative=True)
    assert f.alpha == pytest.approx(A, rel=0.05) and f.beta == pytest.approx(B, rel=0.05)
    assert 0.01 < f.residual < 0.03  # the 2% noise, relative
    # Plain least squares is ruled by the big messages: beta is good, alpha much less so.
    assert fit(samples, "ring", 4).beta == pytest.approx(B, rel=0.05)


def test_fit_needs_two_sizes():
    with pytest.raises(ValueError, match=r"2 distinct sizes; got sizes \[1024.0\]"):
        fit([(1024, 1e-5), (1024, 2e-5)], "ring", 2)


def test_size_range_and_table():
    assert size_range(1024, 8192) == [1024, 2048, 4096, 8192]
    assert size_range()[0] == 1 << 10 and size_range()[-1] == 256 << 20
    with pytest.raises(ValueError, match="lo=4096, hi=1024"):
        size_range(4096, 1024)
    rows = [{"algorithm": "ring", "size": 1024, "count": 256, "p": 2, "time_s": 1e-5, "algbw": 1024 / 1e-5,
             "busbw": 1024 / 1e-5}]
    lines = format_table(rows).splitlines()
    assert lines[0] == "# all_reduce  algorithm: ring  ranks: 2"
    assert "(GB/s)" in lines[2]
    fields = lines[3].split()
    assert fields[:4] == ["1024", "256", "float", "sum"]
    assert float(fields[4]) == pytest.approx(10.0) and float(fields[5]) == pytest.approx(0.102, abs=1e-3)
    assert not math.isnan(float(fields[6]))
