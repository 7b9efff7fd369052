"""A process's peak resident memory, measured apart for a set-up and each step."""

import pytest
import torch

from elastic_trainer.worker.memory_use import peak_rss_bytes, reset_peaks, rss_bytes

CPU = torch.device("cpu")


@pytest.mark.skipif(rss_bytes() is None, reason="no /proc here")
def test_the_peak_follows_an_allocation_and_a_reset_starts_it_anew():
    reset_peaks(CPU)
    base = peak_rss_bytes()
    big = torch.ones(64 << 20, dtype=torch.uint8)   # 64 MiB, touched
    peak = peak_rss_bytes()
    assert peak >= base + (48 << 20)
    del big
    reset_peaks(CPU)
    after = peak_rss_bytes()
    assert after < peak - (32 << 20) and abs(after - rss_bytes()) < (16 << 20)
