"""A seeded fault campaign over the real runtime, with a checker (``elastic-trainer campaign``).

``schedule`` draws faults at named points of a run from a seed; ``strike`` carries each out on a
simulated cluster; ``runner`` runs a schedule against a real run; ``checker`` holds what the
run left to the invariants; ``shrink`` cuts a failing schedule to the fewest faults that still
fail; ``campaign`` runs many and sums them up. docs/campaign.md has the design.
"""
