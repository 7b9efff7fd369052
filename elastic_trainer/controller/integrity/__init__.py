"""The run's side of integrity: anomalous steps recorded, skipped, rolled back or ending the run."""
