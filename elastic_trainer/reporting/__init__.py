"""What a person reads about a run, from the driver: the progress lines (``progress``), the run
report PNG (``report``) and the per-rank figures file beside it (``rank_file``). The trainer
writes them; the CLI's commands reach them through the trainer."""
