"""A user model module as users write them: it makes and reads a tensor when imported, and its
factory looks at real values while building (as one that loads weights from a file would)."""

import torch
from torch import nn

from elastic_trainer.models.gpt import TokenCrossEntropy

# Read at import: under torch.device("meta") this raises "Cannot copy out of meta tensor".
INIT_STD = float(torch.tensor(0.05).item())


def build(vocab_size: int = 256, width: int = 16, depth: int = 2):
    blocks = [nn.Embedding(vocab_size, width)]
    blocks += [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    blocks.append(nn.Linear(width, vocab_size))
    for b in blocks:
        for p in b.parameters():
            nn.init.normal_(p, std=INIT_STD)
    # A build that reads what it made (a sanity check, a weight file's checksum): fails on meta.
    if not torch.isfinite(blocks[0].weight).all():
        raise ValueError("non-finite initial weights")
    return blocks, TokenCrossEntropy()
