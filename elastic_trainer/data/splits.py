"""The training and evaluation windows of a run: ``data.path``, and ``eval.path`` or a held-out share of it."""

from __future__ import annotations

from ..config import DataSection, TrainerConfig
from ..errors import DataError
from .dataset import TokenDataset, split_windows
from .sampler import GlobalSampler

_MIN_MIX = 16


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
        train, evald = train.subset(train_range), train.subset(eval_range)
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


def data_order(data: DataSection, train: TokenDataset) -> tuple[int, int]:
    """``(block, mix)`` of the training order (see ``sampler``). A corpus whose decoded tokens fit in
    the read-ahead is fully permuted (blocks of one window, one mix), which costs no extra reads;
    a larger one mixes as many blocks as the read-ahead holds row groups of, so a mix's row groups
    stay cached while its steps run. A function of the corpus and the config only: the trainer
    records it with durable checkpoints, and a resume refuses another."""
    if not data.shuffle:
        return 1, 1
    if data.shuffle_mix != "auto":
        return data.shuffle_block, data.shuffle_mix
    cap = int(data.read_ahead_mb * (1 << 20))
    if train.decoded_bytes <= cap:
        return 1, len(train)
    return data.shuffle_block, max(_MIN_MIX, cap // max(1, train.largest_group_bytes))


def make_sampler(cfg: TrainerConfig, train: TokenDataset) -> GlobalSampler:
    """The run's sample order over ``train``'s windows."""
    block, mix = data_order(cfg.data, train)
    return GlobalSampler(len(train), cfg.train.seed, cfg.data.shuffle, block, mix)
