"""A rank's own stage written as its part of the final weights, and of the Hugging Face folder.

The part goes to ``run.output_dir`` (and ``<output_dir>/hf`` under Hugging
Face names, for ``model.kind: hf``), read back against its checksum. Where it
cannot be written, the part is left in a fallback folder on this node
(``~/.cache/elastic_trainer/unsaved/<run>/``), so that the ``SaveError``
can say where every part is, and nothing has to be carried to the driver.
"""

from __future__ import annotations

import os

import torch

from ..checkpoint.weights import WeightsError, write_safetensors

FALLBACK_ROOT = "~/.cache/elastic_trainer/unsaved"


def fallback_dir(run_name: str) -> str:
    return os.path.join(os.path.expanduser(FALLBACK_ROOT), run_name)


def write_stage(state: dict[str, torch.Tensor], job: dict, node: str) -> dict:
    """Write ``state`` (this rank's tensors by global name) as ``job`` says: ``where``, ``file``,
    ``meta``, ``retries``, ``run``, and ``hf`` (None, or ``where``, ``file`` and ``names``:
    global -> Hugging Face name of the tensors it writes). ``{"node", "part", "hf", "hf_error"}``
    (their ``write_safetensors`` entries; the HF part's error, if it failed), or where the part
    failed ``{"node", "error", "fallback"}`` (the part's path on this node, None if that failed too)."""
    try:
        part = write_safetensors(job["where"], job["file"], state, job["meta"], job["retries"])
    except WeightsError as e:
        try:
            kept = write_safetensors(fallback_dir(job["run"]), job["file"], state, job["meta"], 1)["path"]
        except WeightsError:
            kept = None
        return {"node": node, "error": str(e), "fallback": kept}
    hf, hf_error = None, None
    if job.get("hf"):
        # The Hugging Face folder is not a condition of the weights: its failure is told apart.
        names = job["hf"]["names"]
        try:
            hf = write_safetensors(job["hf"]["where"], job["hf"]["file"],
                                   {names[n]: t for n, t in state.items() if n in names}, {"format": "pt"},
                                   job["retries"], as_json=False)
        except WeightsError as e:
            hf_error = str(e)
    return {"node": node, "part": part, "hf": hf, "hf_error": hf_error}
