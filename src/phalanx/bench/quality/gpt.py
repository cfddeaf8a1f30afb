"""A small byte-level GPT (nanoGPT's shape: pre-norm blocks, causal self-attention, tied embeddings).

Example:
    >>> import torch
    >>> model = GPT(layers=2, heads=2, width=32, block=16)
    >>> model(torch.zeros(3, 16, dtype=torch.long)).shape
    torch.Size([3, 16, 256])
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256  # bytes: no tokenizer to fix, every corpus byte is a symbol


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level language model: ``(batch, block)`` int64 bytes -> ``(batch, block, 256)`` logits."""

    def __init__(self, *, layers: int = 3, heads: int = 4, width: int = 128, block: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.zeros(block, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.tok.weight, std=0.02)  # tied output: unit-variance rows would start at loss ~90

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()  # tied: the output layer is the embedding
