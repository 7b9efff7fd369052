"""Replacements from Ray's own autoscaler (controller.replanning.replacements): on a cluster whose
head runs the autoscaler with the fake multi-node provider (real raylets on this machine), the
run asks for its workers at a start with no room, and again when a node is lost; the autoscaler
launches the nodes, the run grows back to its full layout, and the request is withdrawn each
time the run is whole and at its end.

The scenario runs as a process of its own (``replacements_scenario``), without token
authentication as the cluster's head: the suite's process is in token mode once a local Ray
started in it found ~/.ray/auth_token, and a driver in token mode is taken for failed by a head
without one, its controller destroyed before it ran."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(360)]

ROOT = Path(__file__).resolve().parents[2]


def test_a_lost_node_is_asked_back_from_the_autoscaler_and_the_run_grows_back(own_ray, corpus_dir, tmp_path):
    out = tmp_path / "out.json"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "tests.integration.replacements_scenario", str(corpus_dir),
                           str(tmp_path), str(out)], cwd=ROOT, env=env, timeout=330,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-6000:]
    got = json.loads(out.read_text())
    # The machine's current cluster (which `ray.init()` without an address joins) is not left naming it.
    assert got["current"] != got["address"]
    assert got["stopped"] and got["grown_back"], got["state"]
    asks = got["asks"]
    assert [e["action"] for e in asks] == ["requested", "withdrawn", "requested", "withdrawn"], asks
    assert asks[0]["short"] == 2 and asks[2]["short"] == 1 and asks[2]["bundles"] == 2, asks
    # The loss is seen by whichever comes first: Ray's word that the actor died (its node's health
    # checks fail after ~4 s here) or the worker's missed heartbeats (1 s), the latter on a loaded
    # machine. Either way it is the killed node's worker, and the next re-plan is the grow back.
    assert got["recoveries"][0] in ("death", "silent") and got["recoveries"][1] == "grow", got["recoveries"]
    assert {f["node"] for f in got["failures"][:1]} == {got["killed"]}, got["failures"]
    assert got["last_plan"]["world_size"] == 2
    assert got["killed"] not in got["last_plan"]["rank_nodes"].values()
