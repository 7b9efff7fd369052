"""Training that cannot be silently poisoned: each step's verdict (non-finite values, spikes),
agreed over every rank, and the checks that replicas still hold the same state."""
