"""A restore checked tensor by tensor (``checkpoint.verify_restores``): what the ranks of each stage
hold after loading against what the parts they read held when saved, as layout-free fingerprints
(``checkpoint.fingerprint``). Pure: no Ray."""

from __future__ import annotations

from ...checkpoint.fingerprint import add


def check_restore(fingerprints: dict[int, dict], blocks_of: dict[int, list[int]]) -> dict | None:
    """``fingerprints``: rank -> its ``StageState.restore_fingerprints`` (None where it restored
    nothing); ``blocks_of``: rank -> its blocks. Returns ``{"tensors": compared, "unverified": held
    but never fingerprinted when saved (a durable checkpoint's), "differ": [name|kind ...]}``, or None
    where no rank restored.

    Every replica holds its stage's weights whole, and each must equal the saved weights. The
    moments of a sharded stage are the sum over its ranks' owned ranges; a whole rank's, its own."""
    got = {r: fp for r, fp in fingerprints.items() if fp}
    if not got:
        return None
    stages: dict[tuple, list[dict]] = {}
    for r, fp in sorted(got.items()):
        stages.setdefault(tuple(sorted(blocks_of[r])), []).append(fp)
    tally = {"tensors": 0, "unverified": 0}
    differ: set = set()

    def compare(key: str, held, saved: dict) -> None:
        if key not in saved:
            tally["unverified"] += 1
        else:
            tally["tensors"] += 1
            if held != saved[key]:
                differ.add(key)

    for fps in stages.values():
        saved: dict = {}
        for fp in fps:
            for k, v in fp["saved"].items():
                saved.setdefault(k, v)
        summed: dict = {}
        for fp in fps:
            for k, v in fp["held"].items():
                if fp["sharded"] and isinstance(v, int) and not k.endswith("|param"):
                    summed[k] = add(summed.get(k, 0), v)   # this rank's range of the moments
                else:
                    compare(k, v, saved)
        for k, v in summed.items():
            compare(k, v, saved)
        # Saved but held by no rank of the stage: state the restore dropped.
        held = set(summed) | {k for fp in fps for k in fp["held"]}
        differ |= {k for k in saved if k not in held}
    return {**tally, "differ": sorted(differ)}
