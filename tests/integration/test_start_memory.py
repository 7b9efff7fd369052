"""A starting layout over ``scaling.worker_memory_gb`` stops the run before any worker is placed."""

import pytest

from elastic_trainer import Trainer, TrainerConfig
from elastic_trainer.errors import ConfigError

from ..conftest import tiny_config

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
def test_a_start_over_the_memory_bound_fails_before_a_step(cluster, corpus_dir):
    # The tiny GPT as 2 x 2 needs about 1.1 MiB on its heaviest rank; 1 x 4 about 0.7 MiB.
    cfg = TrainerConfig.from_dict(tiny_config(corpus_dir, parallel={"dp": 2, "pp": 2}, run={"name": "start-mem"},
                                              train={"steps": 2}, scaling={"worker_memory_gb": 0.0008}))
    steps = []
    with pytest.raises(ConfigError, match=r"parallel\.dp\(2\) x parallel\.pp\(2\), stages \[\[0, 4\], \[4, 8\]\], "
                                          r"does not fit scaling\.worker_memory_gb\(0\.0008\)") as e:
        Trainer(cfg, verbose=False, on_step=steps.append).fit()
    assert steps == []
    assert "dp=1 pp=4" in str(e.value) and "scaling.worker_memory_gb >= 0.0011 runs dp=2 pp=2" in str(e.value)
