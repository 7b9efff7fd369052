"""Layout-free fingerprints: slices add up to the whole, and one changed bit anywhere shows."""

import numpy as np

from elastic_trainer.checkpoint.fingerprint import add, part_fingerprint, range_fingerprint, saved_fingerprint


def test_slices_add_up_to_the_whole_and_any_changed_bit_shows():
    rng = np.random.default_rng(0)
    w = rng.standard_normal(3000).astype(np.float32)
    whole = range_fingerprint(w, 0)
    for cuts in ([0, 1500, 3000], [0, 7, 1001, 2999, 3000]):
        total = 0
        for a, z in zip(cuts, cuts[1:]):
            total = add(total, range_fingerprint(w[a:z], a))
        assert total == whole
    flipped = w.copy()
    flipped.view(np.uint32)[1234] ^= 1   # the lowest mantissa bit of one element
    assert range_fingerprint(flipped, 0) != whole
    # Two elements swapped: the same values, elsewhere.
    swapped = w.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert range_fingerprint(swapped, 0) != whole
    # bf16's bits (as the parts keep them) and float64 hash too.
    assert range_fingerprint(w.view(np.uint16), 0) != range_fingerprint(w.astype(np.float64), 0)


def test_parts_of_two_shardings_give_the_same_saved_fingerprint():
    rng = np.random.default_rng(1)
    p, m = rng.standard_normal(10).astype(np.float32), rng.standard_normal(10).astype(np.float32)
    name = "blocks.0.w"
    whole = {"step": 3, "blocks": [0], "params": {name: p}, "optim": {name: {"exp_avg": m, "step": np.float32(3)}}}
    halves = [{"step": 3, "blocks": [0], "params": {name: p[a:z]}, "ranges": {name: [a, z, [10]]},
               "optim": {name: {"exp_avg": m[a:z], "step": np.float32(3)}}} for a, z in ((0, 4), (4, 10))]
    for s in [whole, *halves]:
        s["fingerprint"] = part_fingerprint(s)
    assert saved_fingerprint([whole], [name]) == saved_fingerprint(halves, [name])
    assert saved_fingerprint(halves, [name])[f"{name}|step"] == 3.0
    # The same part read twice counts once.
    assert saved_fingerprint([halves[0], halves[0], halves[1]], [name]) == saved_fingerprint(halves, [name])
