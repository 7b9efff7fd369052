"""A node loss in bf16 and fp16 runs: the loss curve continues, and so does fp16's loss scale.

Beside ``test_precision``: these tests kill nodes (``fresh_cluster``).
"""

import pytest

from elastic_trainer import Trainer

from ..helpers import reference_run
from .test_recovery import Chaos, assert_contiguous_data, config, node_of_rank

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_recovery_continues_the_loss_curve_and_the_loss_scale(fresh_cluster, corpus_dir, precision):
    c, nodes = fresh_cluster(4)
    name = f"prec-{precision}"
    # fp16: from a low scale, doubling every 3 good steps, it moves before and after the loss, far
    # from fp16's overflow (near it, a skip turns on the last bits of the weights, which the change
    # of plan moves: the comparison with one process would then be about luck).
    train = [f"train.precision={precision}", "train.loss_scale_init=256", "train.loss_scale_growth_interval=3"]
    cfg = config(corpus_dir, name, steps=16, parallel={"dp": 2, "pp": 2}).with_overrides(train)
    kill = Chaos().at(6, lambda: c.remove_node(node_of_rank(name, 3, nodes), allow_graceful=False))
    result = Trainer(cfg, verbose=False, on_step=kill).fit()
    assert_contiguous_data(result, cfg)
    [rec] = result.recoveries
    ref_cfg = config(corpus_dir, name, steps=16).with_overrides(train)
    ref = reference_run(ref_cfg, cfg.train.steps, micro_batches=cfg.train.global_batch_size // cfg.train.micro_batch_size)[0]
    # As the fp32 recovery tests: the same curve, within 1e-3 once the plan has changed.
    assert [r["loss"] for r in result.history] == pytest.approx(ref, rel=1e-3)
    if precision == "fp16":
        scales = [r["loss_scale"] for r in result.history]
        assert len(set(scales)) > 2, scales  # the scale moved, before and after the loss
        for before, after, r in zip(scales, scales[1:], result.history):
            # Across the restore too: the restored step's scale came back with its state.
            assert after in ((before / 2,) if r["skipped"] else (before, 2 * before)), (r["step"], scales)
    else:
        assert all(r["loss_scale"] is None for r in result.history)
    assert rec["restored_step"] >= 1
