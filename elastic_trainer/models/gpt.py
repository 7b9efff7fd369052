"""A small byte-level GPT expressed as an ordered list of blocks.

The model is ``[Embedding, TransformerBlock * n_layer, Head]`` so that any
contiguous run of blocks can be a pipeline stage. There is no weight tying
between embedding and head: tied weights would pin the first and last blocks
to one stage.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, seq_len: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))


class TransformerBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Head(nn.Module):
    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(x))


class TokenCrossEntropy(nn.Module):
    """Mean next-token cross entropy over every position of every sequence."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def build_gpt(
    n_layer: int = 4,
    n_head: int = 4,
    d_model: int = 128,
    seq_len: int = 128,
    vocab_size: int = 256,
    dropout: float = 0.0,
) -> tuple[list[nn.Module], nn.Module]:
    """Return ``(blocks, loss_fn)`` for a GPT-2 style model."""
    blocks: list[nn.Module] = [Embedding(vocab_size, d_model, seq_len, dropout)]
    blocks += [TransformerBlock(d_model, n_head, dropout) for _ in range(n_layer)]
    blocks.append(Head(d_model, vocab_size))
    for block in blocks:
        for name, module in block.named_modules():
            init_gpt_module(name, module, n_layer)
    return blocks, TokenCrossEntropy()


@torch.no_grad()
def init_gpt_module(name: str, module: nn.Module, n_layer: int) -> None:
    """GPT-2 initialisation of ``module``'s own parameters (``name``: its name in its block).

    Residual projections are scaled by depth so the residual stream's variance does not grow
    with ``n_layer``; layer norms start as the identity.
    """
    for pname, p in module.named_parameters(recurse=False):
        full = f"{name}.{pname}" if name else pname
        if full.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * n_layer) if full.startswith(("proj", "out")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
        else:
            nn.init.ones_(p)
