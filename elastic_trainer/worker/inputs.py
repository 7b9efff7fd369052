"""A rank's batches: read once, by the first stage, with the targets sent to the last stage.

Only the rank holding the first pipeline stage reads token windows; inputs
and targets come from that one read (targets are the inputs shifted by one).
Where the last stage is another rank it receives the targets from the first
over the replica's pipeline group, behind a header naming the batch and a
fingerprint of the windows. The last stage computes the same fingerprint
from the sampler (it opens the corpus's metadata, never its rows), so two
ranks that disagree on what a step reads fail at once instead of training on
mismatched inputs and targets. The first stage prefetches the next step's
windows while this one runs.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..config import TrainerConfig
from ..data.skips import add_range, cursor
from ..data.splits import make_sampler, open_datasets
from ..errors import DataError
from ..parallel.topology import Topology

_TRAIN, _EVAL = 1, 2


class StageInputs:
    """Batches for one rank of replica ``replica``: ``(x, y)`` with None where the rank needs neither."""

    def __init__(self, cfg: TrainerConfig, topo: Topology, replica: int, has_first: bool, has_last: bool,
                 group, device: torch.device):
        self.cfg, self.topo, self.replica, self.group, self.device = cfg, topo, replica, group, device
        self.has_first, self.has_last = has_first, has_last
        self.train = self.eval = None
        if has_first or has_last:
            self.train, self.eval = open_datasets(cfg, cfg.failure.storage_retries)
        self.sampler = make_sampler(cfg, self.train) if self.train is not None else None
        self.first_rank = topo.rank(replica, 0)
        self.last_rank = topo.rank(replica, topo.pp - 1)
        # The sample ranges never read (data.skip_samples: the config's and the run's so far), to
        # which a skipped step adds its batch.
        self.skips = [tuple(r) for r in cfg.data.skip_samples]
        self.faults = None   # integrity faults (worker.integrity_faults), where injection is allowed

    def cursor(self, step: int) -> int:
        """The first sample of ``step``, past the skipped ranges."""
        return cursor(step, self.cfg.train.global_batch_size, self.skips)

    def skip(self, step: int) -> list[int]:
        """Leave out ``step``'s batch (its run again reads the next one); the range left out."""
        start = self.cursor(step)
        end = start + self.cfg.train.global_batch_size
        self.skips = add_range(self.skips, start, end)
        return [start, end]

    def _rows(self, step: int, shares: list[int] | None = None) -> np.ndarray:
        gb, mb = self.cfg.train.global_batch_size, self.cfg.train.micro_batch_size
        samples = [n * mb for n in shares] if shares is not None else None
        return self.sampler.replica_rows(self.cursor(step), gb, self.topo.dp, self.replica, samples)

    def _eval_rows(self, batch: int) -> np.ndarray:
        gb = self.cfg.train.global_batch_size
        per = gb // self.topo.dp
        return np.arange(batch * gb + self.replica * per, batch * gb + (self.replica + 1) * per)

    def train_batch(self, step: int, shares: list[int] | None = None):
        """Step ``step``'s share of this replica (``shares``: micro-batches per replica, None for
        equal ones), and the next step's read started, on the same shares."""
        if self.train is None:
            return None, None
        rows = self._rows(step, shares)
        at = self.cursor(step)
        poison = (self.faults is not None and self.has_first
                  and self.faults.poisoned(at, self.cfg.train.global_batch_size))
        out = self._get(self.train, rows, (_TRAIN, step, 0), poison_seed=at if poison else None)
        if self.has_first and step < self.cfg.train.steps:
            self.train.prefetch(self._rows(step + 1, shares))
        return out

    def eval_batch(self, step: int, batch: int):
        """Evaluation batch ``batch`` (of ``eval.batches``), the same windows at every evaluation."""
        if self.eval is None:
            return None, None
        return self._get(self.eval, self._eval_rows(batch), (_EVAL, step, batch))

    def _get(self, ds, rows: np.ndarray, tag: tuple[int, int, int], poison_seed: int | None = None):
        fp = ds.windows_fingerprint(rows)
        n, seq = len(rows), self.cfg.data.seq_len
        if self.has_first:
            x, y = ds.sample(rows)
            if poison_seed is not None:   # an injected fault: every target the batch's rarest token, junk
                values, counts = np.unique(y, return_counts=True)
                y = np.full_like(y, values[np.argmin(counts)])
            x, y = torch.from_numpy(x), torch.from_numpy(y)
            if self.has_last:
                return x.to(self.device), y.to(self.device)
            # On the rank's device: NCCL sends device tensors only.
            dist.send(torch.tensor([*tag, fp], dtype=torch.int64, device=self.device), dst=self.last_rank,
                      group=self.group)
            dist.send(y.to(self.device).contiguous(), dst=self.last_rank, group=self.group)
            return x.to(self.device), None
        header = torch.empty(4, dtype=torch.int64, device=self.device)
        dist.recv(header, src=self.first_rank, group=self.group)
        got = tuple(int(v) for v in header)
        if got != (*tag, fp):
            raise DataError(f"rank {self.last_rank} expected the targets of batch {tag} (windows fingerprint "
                            f"{fp}) from rank {self.first_rank}, which sent {got[:3]} (fingerprint {got[3]}): "
                            "the two stages read different windows")
        y = torch.empty(n, seq, dtype=torch.int64, device=self.device)
        dist.recv(y, src=self.first_rank, group=self.group)
        return None, y

    def close(self) -> None:
        for ds in (self.train, self.eval):
            if ds is not None:
                ds.close()
