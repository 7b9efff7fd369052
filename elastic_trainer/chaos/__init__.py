"""Chaos tooling the CLI and the tests offer: simulated multi-node clusters on one machine
(``simulate``: nodes to kill, freeze and slow) and the soak that loses nodes at seeded random
moments (``soak``). Nothing in the runtime imports it."""
