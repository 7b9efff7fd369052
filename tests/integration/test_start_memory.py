"""A starting layout over ``scaling.worker_memory_gb`` stops the run before any worker is placed,
unless sharding its optimizer makes it fit (``parallel.shard_optimizer: auto``)."""

import pytest

from elastic_trainer import Trainer, TrainerConfig
from elastic_trainer.errors import ConfigError

from ..conftest import tiny_config

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
def test_a_start_over_the_memory_bound_fails_before_a_step_or_runs_sharded(cluster, corpus_dir):
    # The tiny GPT as 2 x 2 needs 0.39355 GiB on its heaviest rank unsharded (most of it the
    # process itself); 1 x 4 0.39208 GiB.
    def cfg(shard):
        return TrainerConfig.from_dict(tiny_config(corpus_dir, parallel={"dp": 2, "pp": 2, "shard_optimizer": shard},
                                                   run={"name": f"start-mem-{shard}"}, train={"steps": 2},
                                                   scaling={"worker_memory_gb": 0.393}))

    steps = []
    with pytest.raises(ConfigError, match=r"parallel\.dp\(2\) x parallel\.pp\(2\), stages \[\[0, 4\], \[4, 8\]\], "
                                          r"does not fit scaling\.worker_memory_gb\(0\.393\)") as e:
        Trainer(cfg("none"), verbose=False, on_step=steps.append).fit()
    assert steps == []
    assert "dp=1 pp=4" in str(e.value) and "scaling.worker_memory_gb >= 0.394 runs dp=2 pp=2" in str(e.value)

    # The default shards it: the same layout then fits, and runs with its moments split.
    result = Trainer(cfg("auto"), verbose=False).fit()
    assert [r["step"] for r in result.history] == [1, 2]
    assert result.plan["shard_optimizer"] == "gradients"
    assert all(r["comm_bytes"] > 0 for r in result.history)
