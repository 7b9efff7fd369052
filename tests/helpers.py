"""A user model factory for tests: a tiny token MLP as blocks (imported by path from configs)."""

from torch import nn

from elastic_trainer.models.gpt import TokenCrossEntropy


def build_mlp(vocab_size: int = 256, width: int = 16, depth: int = 3):
    blocks = [nn.Embedding(vocab_size, width)]
    blocks += [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    blocks.append(nn.Linear(width, vocab_size))
    return blocks, TokenCrossEntropy()


def not_a_pair():
    return [nn.Linear(2, 2)]
