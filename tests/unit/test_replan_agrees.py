"""The policy and the planner choose the same plan on the same inputs, across a table of cluster shapes.

Two entry points, reached independently: ``choose_plan`` as the controller
calls it after a failure (only the configured codec's rows, cached model and
constants), and ``elastic-trainer plan --json`` as a user runs it (every
row, then its ``replan`` pick).
"""

import contextlib
import io
import json

import pytest

from elastic_trainer.cli.commands import main
from elastic_trainer.config import TrainerConfig
from elastic_trainer.planning.policy import choose_plan

WORKERS = range(1, 9)
SCHEDULES = ("gpipe", "1f1b", "interleaved")
MODES = [("none", "allreduce"), ("int8", "allreduce"), ("powersgd", "allreduce"), ("none", "diloco"),
         ("none", "parameter_server")]
# GiB per worker: no bound, one that only some layouts of each schedule meet, and one that still fewer meet.
MEMORY_GB = (None, 4.5 / 1024, 3.0 / 1024)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A small GPT (8 blocks) with cheap communication, so that layouts, codecs and bounds all change the pick."""
    d = tmp_path_factory.mktemp("replan")
    constants = d / "constants.json"
    fit = {"alpha_s": 2e-5, "beta_s_per_byte": 2e-10}
    constants.write_text(json.dumps({"algorithms": {k: fit for k in ("ring", "tree", "chunked")}}))
    path = d / "job.yaml"
    path.write_text(f"""
model: {{kind: gpt, n_layer: 6, n_head: 2, d_model: 64, seq_len: 32}}
data: {{path: {d / 'no-data'}, seq_len: 32}}
train: {{global_batch_size: 16, micro_batch_size: 2}}
parallel: {{dp: 1, pp: 2}}
scaling: {{backend: gloo}}
comm: {{constants: {constants}}}
""")
    return path


def _plan_cli(argv: list[str]) -> tuple[int, dict | None]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, (json.loads(out.getvalue()) if rc == 0 else err.getvalue())


@pytest.mark.parametrize("gb", MEMORY_GB, ids=lambda g: "unbounded" if g is None else f"{g * 1024:.1f}MiB")
@pytest.mark.parametrize("compression,sync", MODES, ids=lambda m: m)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_choose_plan_and_plan_cli_pick_the_same_layout(job, schedule, compression, sync, gb):
    sets = [f"parallel.schedule={schedule}", f"comm.compression={compression}", f"comm.sync={sync}"]
    cfg = TrainerConfig.from_yaml(job, sets)
    memory = None if gb is None else gb * (1 << 30)
    picks = []
    for n in WORKERS:
        choice = choose_plan(cfg, n, memory)
        argv = ["plan", str(job), "--json", "--workers", str(n)] + [a for s in sets for a in ("--set", s)]
        rc, out = _plan_cli(argv + ([] if gb is None else ["--memory-gb", repr(gb)]))
        if choice is None:
            assert rc == 2 and "no dp x pp" in out, (n, out)
            picks.append(None)
            continue
        assert rc == 0, (n, out)
        row = out["predictions"]["replan"]
        assert (choice.dp, choice.pp, [list(b) for b in choice.stage_bounds]) == (
            row["dp"], row["pp"], row["stage_bounds"]), n
        assert choice.est_step_s == pytest.approx(row["total_s"]) and choice.memory_bytes == row["memory_bytes"]
        assert memory is None or row["memory_bytes"] <= memory
        assert out["predictions"]["constants"].endswith("constants.json")
        picks.append((choice.dp, choice.pp))
    # The table is worth running only if it has something to agree on.
    if gb is None:
        assert None not in picks[1:] and len(set(picks)) >= 3, picks
