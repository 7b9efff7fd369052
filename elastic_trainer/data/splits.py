"""The training and evaluation windows of a run: ``data.path``, and ``eval.path`` or a held-out share of it."""

from __future__ import annotations

from ..config import TrainerConfig
from ..errors import DataError
from .dataset import TokenDataset, split_windows


def open_datasets(cfg: TrainerConfig, retries: int = 3) -> tuple[TokenDataset, TokenDataset | None]:
    """``(train, eval)``: eval is None without ``eval.every``. With ``eval.fraction`` the last
    windows of ``data.path`` are held out (training never reads them); the split is a function of
    the corpus alone, so it is the same at every layout and across restarts."""
    ev = cfg.eval
    train = TokenDataset.open(cfg.data, retries=retries)
    if not ev.enabled:
        return train, None
    if ev.fraction is not None:
        train_range, eval_range = split_windows(len(train), ev.fraction)
        evald = TokenDataset.open(cfg.data, retries=retries, window_range=eval_range)
        train = TokenDataset.open(cfg.data, retries=retries, window_range=train_range)
    else:
        section = cfg.data.model_copy(update={"path": ev.path, "prepare": None, "shuffle": False})
        evald = TokenDataset.open(section, retries=retries)
    need = ev.batches * cfg.train.global_batch_size
    if len(evald) < need:
        where = f"eval.path({ev.path!r})" if ev.path else f"eval.fraction({ev.fraction}) of {cfg.data.path!r}"
        raise DataError(f"{where} holds {len(evald)} windows of seq_len({cfg.data.seq_len}) + 1; an evaluation "
                        f"reads eval.batches({ev.batches}) * train.global_batch_size({cfg.train.global_batch_size}) "
                        f"= {need}: lower eval.batches or give more evaluation data")
    return train, evald
