"""Reference models, written here because torchvision is not available.

* :func:`mlp`: the 784-5x1024-10 MLP, the communication-heavy case (5.0M parameters).
* :func:`resnet_cifar`: ResNet-20/32/56/110 for 3x32x32 inputs (He et al. 2016, section 4.2).
* :func:`resnet50`: the ImageNet bottleneck ResNet-50 (25.6M parameters).
* :func:`digits_cnn`: a small CNN for scikit-learn's 8x8 digits.
* :func:`gpt`: a small decoder-only transformer (GPT-2 layout: pre-norm, causal attention, tied head).

Example:
    >>> import torch, phalanx.bench.models as M
    >>> M.resnet_cifar(20)(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..errors import ConfigError, usage


def mlp(in_features: int = 784, hidden: int = 1024, depth: int = 5, classes: int = 10) -> nn.Sequential:
    """``depth`` hidden layers of ``hidden`` units with ReLU."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class _Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNetCifar(nn.Module):
    """ResNet for CIFAR: depth = 6n + 2, three stages of 16/32/64 channels."""

    def __init__(self, depth: int = 20, classes: int = 10) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ConfigError(usage(f"resnet_cifar depth={depth}", "6n+2 (20, 32, 44, 56, 110)",
                                    "Pick one of the standard depths."))
        n = (depth - 2) // 6
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        blocks, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(n):
                blocks.append(_Basic(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def resnet_cifar(depth: int = 20, classes: int = 10) -> ResNetCifar:
    return ResNetCifar(depth, classes)


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.short(x))


def resnet50(classes: int = 1000) -> nn.Sequential:
    """ResNet-50 (He et al. 2016) for 3x224x224 inputs."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                               nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(count):
            layers.append(_Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def digits_cnn(classes: int = 10) -> nn.Sequential:
    """A small CNN for 1x8x8 digits; no BatchNorm, so data-parallel equals one process exactly."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, classes))


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP, each with a residual."""

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
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids ``(batch, time)`` -> next-token logits ``(batch, time, vocab)``; nanoGPT's shape.

    Pre-norm blocks, causal attention, learned positions, and the output layer tied to the
    token embedding (as in GPT-2). Embeddings start at N(0, 0.02²) as in GPT-2: with
    unit-variance rows a tied output would start at a loss near 90 instead of ln(vocab).
    """

    def __init__(self, vocab: int = 8192, context: int = 256, dim: int = 384, layers: int = 6, heads: int = 6) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()  # tied: the output layer is the embedding


def gpt(vocab: int = 8192, context: int = 256, dim: int = 384, layers: int = 6, heads: int = 6) -> GPT:
    """A small GPT (about 14M parameters by default); train with ``F.cross_entropy(out.flatten(0, 1), y.flatten())``.

    The GPU benchmark uses the default; the time-to-quality benchmark a byte-level one
    (``gpt(vocab=256, context=64, dim=128, layers=3, heads=4)``, 636k parameters).

    Example:
        >>> gpt(vocab=32, context=8, dim=16, layers=1, heads=2)(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 32])
    """
    return GPT(vocab, context, dim, layers, heads)


# name -> (builder, per-sample input shape, classes): what the benchmark runs on synthetic data
ZOO: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    "mlp": (mlp, (784,), 10),
    "resnet20": (lambda: resnet_cifar(20), (3, 32, 32), 10),
    "resnet32": (lambda: resnet_cifar(32), (3, 32, 32), 10),
    "resnet56": (lambda: resnet_cifar(56), (3, 32, 32), 10),
    "resnet110": (lambda: resnet_cifar(110), (3, 32, 32), 10),
    "resnet50": (resnet50, (3, 224, 224), 1000),
    "digits_cnn": (digits_cnn, (1, 8, 8), 10),
}


def build(name: str) -> tuple[nn.Module, tuple[int, ...], int]:
    """A fresh model by name, with its input shape and class count."""
    if name not in ZOO:
        raise ConfigError(usage(f"unknown model {name!r}", "one of " + ", ".join(ZOO), "Pick a listed model."))
    builder, shape, classes = ZOO[name]
    return builder(), shape, classes


def load_digits_split(test_fraction: float = 0.25, seed: int = 0):
    """scikit-learn's bundled 8x8 digits (no download) as train/test TensorDatasets, scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    from torch.utils.data import TensorDataset

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])
