"""How a run ends: a durable write that fails mid-run is told on the driver while the run goes on.
(A stop asked from outside: ``test_run_handle``.)"""

import pytest

from elastic_trainer import Trainer
from elastic_trainer.controller.state.saving import SaveError

from .test_recovery import config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_a_durable_write_that_fails_mid_run_is_told_on_the_driver_as_it_happens(cluster, corpus_dir, tmp_path,
                                                                                capsys):
    (tmp_path / "file").write_text("in the way")
    storage = str(tmp_path / "file" / "ck")
    cfg = config(corpus_dir, "durable-fails", steps=4, checkpoint={"storage": storage, "durable_every": 2},
                 failure={"storage_retries": 0}, run={"output_dir": str(tmp_path / "out")})
    # The storage never comes back, so the final checkpoint fails the run at its end, as before.
    with pytest.raises(SaveError, match=r"did not save the final durable checkpoint of step 4"):
        Trainer(cfg).fit()
    out = capsys.readouterr().out
    # The mid-run write's failure reached the driver while the run went on: a line of its own.
    mid = [ln for ln in out.splitlines() if ln.startswith("!! durable checkpoint of step 2 failed")]
    assert len(mid) == 1, out
    mid = mid[0]
    assert "(the run goes on from memory; none written since the run started): NotADirectoryError" in mid
    assert out.index(mid) < out.index("!! durable checkpoint of step 4 failed")
