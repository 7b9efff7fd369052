"""Every compression and sync mode trains the demo GPT about as well as plain all-reduce,
with the bytes the comm layer counts falling as far as the codec promises.

Runs the shipped demo model (4 layers, d_model 128, byte-level stdlib corpus)
at dp=2 x pp=1 for STEPS steps and compares the mean loss of the last
WINDOW steps with the uncompressed run's: within 5%. 60 steps is where the
demo's loss has fallen from ~5.6 to ~3 and is still falling steeply, so a
mode that trains worse shows.
"""

import os

import pytest

from elastic_trainer import Trainer, TrainerConfig
from elastic_trainer.comm.algorithms import ring_allreduce_bytes
from elastic_trainer.models.factory import block_param_counts

from ..conftest import weights_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS, WINDOW = 60, 10
# Byte reduction each codec must reach against fp32 all-reduce on the demo model at dp=2.
# topk-sparse_reduce sends about 2k pairs at any dp, against the all-gather's (dp - 1) k: twice
# as many at dp=2, fewer from dp=4 (tests/unit/test_comm_algorithms.py counts dp = 2, 4, 8).
MIN_REDUCTION = {"fp16": 2.0, "bf16": 2.0, "int8": 3.5, "topk": 30.0, "topk-sparse_reduce": 15.0, "powersgd": 10.0}
# Allowed gap of the tail loss to the uncompressed run. The target is 5% for every codec;
# top-k at 1% with AdamW misses it. Measured at step 60: 18% behind without a warm-up, 8.7%
# with a 30-step sparsity warm-up (which this test runs; 8.3-11% at step 150), so its bound
# only guards against it getting worse. See docs/communication.md.
MAX_GAP = {"topk": 0.12, "topk-sparse_reduce": 0.12}
EXTRA = {"powersgd": ["comm.powersgd_start_step=5"], "topk": ["comm.topk_warmup_steps=30"],
         "topk-sparse_reduce": ["comm.topk_warmup_steps=30", "comm.topk_exchange=sparse_reduce"]}


def demo(name: str, *overrides: str) -> TrainerConfig:
    return TrainerConfig.from_yaml("jobs/demo.yaml", [
        f"train.steps={STEPS}", f"run.name={name}", "run.report_dir=null", "parallel.dp=2", "parallel.pp=1",
        f"run.output_dir={os.path.join(weights_dir(), name)}",   # not the checkout's elastic_trainer_reports/
        "checkpoint.memory_every=1000", *overrides])


def tail_loss(result) -> float:
    return sum(r["loss"] for r in result.history[-WINDOW:]) / WINDOW


@pytest.fixture(scope="module")
def baseline(cluster):
    return Trainer(demo("cm-none"), verbose=False).fit()


def test_uncompressed_bytes_are_the_ring_all_reduce_of_every_gradient(baseline):
    cfg = demo("x")
    n_params = sum(block_param_counts(cfg.model))
    per_rank = ring_allreduce_bytes(n_params * 4, 2)
    # Buckets round each to whole elements per rank; two ranks send.
    assert all(abs(r["comm_bytes"] - 2 * per_rank) <= 2 * 8 * 4 for r in baseline.history)
    assert all(r["compression_ratio"] == pytest.approx(1.0, rel=1e-3) for r in baseline.history)
    # Timed, apart from the compute (how much of it is hidden is benchmarks/comm.py's figure:
    # comm_s and exposed_comm_s per mode).
    assert all(r["exposed_comm_s"] >= 0 and r["comm_time_s"] > 0 for r in baseline.history)


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "topk", "topk-sparse_reduce", "powersgd"])
def test_compression_trains_like_all_reduce_on_fewer_bytes(cluster, baseline, codec):
    result = Trainer(demo(f"cm-{codec}", f"comm.compression={codec.split('-')[0]}", *EXTRA.get(codec, [])),
                     verbose=False).fit()
    assert tail_loss(result) == pytest.approx(tail_loss(baseline), rel=MAX_GAP.get(codec, 0.05))
    dense = baseline.history[-1]["comm_bytes"]
    sent = result.history[-1]["comm_bytes"]
    assert dense / sent >= MIN_REDUCTION[codec], (codec, dense, sent)
    assert result.history[-1]["compression_ratio"] == pytest.approx(dense / sent, rel=0.01)


@pytest.mark.parametrize("sync", ["local_sgd", "diloco", "local_sgd-fp16"])
def test_local_updates_train_like_all_reduce_and_talk_every_local_steps(cluster, baseline, sync):
    sync, _, codec = sync.partition("-")
    result = Trainer(demo(f"cm-{sync}{codec}", f"comm.sync={sync}", "comm.local_steps=4",
                          f"comm.compression={codec or 'none'}"), verbose=False).fit()
    assert tail_loss(result) == pytest.approx(tail_loss(baseline), rel=0.05)
    talking = [r["step"] for r in result.history if r["comm_bytes"] > 0]
    assert talking == list(range(4, STEPS + 1, 4))
    # One model average per 4 steps: a quarter of all-reduce's bytes (an eighth with the change in fp16).
    sent = sum(r["comm_bytes"] for r in result.history)
    dense = sum(r["comm_bytes"] for r in baseline.history)
    assert sent == pytest.approx(dense / (8 if codec else 4), rel=0.01)


def test_parameter_server_trains_like_all_reduce(cluster, baseline):
    result = Trainer(demo("cm-ps", "comm.sync=parameter_server", "comm.ps_shards=2"), verbose=False).fit()
    # Clipping is per replica before the push (the mean of clipped gradients), so close, not equal.
    assert tail_loss(result) == pytest.approx(tail_loss(baseline), rel=0.05)
    n_params = sum(block_param_counts(demo("x").model))
    # Each of the 2 replicas pushes every gradient and pulls every parameter, in fp32.
    assert all(r["comm_bytes"] == 2 * 2 * n_params * 4 for r in result.history)
