"""Deciding how a run is laid out: the calibrated cost model, its calibration sweep, the planner and the re-plan policy."""
