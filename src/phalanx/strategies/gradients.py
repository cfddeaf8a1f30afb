"""Gradient averaging as one process would compute it: the pieces every gradient rule shares.

Public so that a user's own rule can use them (``px.fill_missing_grads``).

Example:
    >>> import torch, phalanx as px
    >>> a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(1))
    >>> (3 * a).sum().backward()
    >>> [g.tolist() for g in px.fill_missing_grads([a, b])]   # b took no part in the loss
    [[3.0, 3.0], [0.0]]
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..batchweight import batch_weight
from ..comm import Comm


def fill_missing_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every parameter's ``.grad``; one that got none in this pass gets zeros, so every rank sends the same shapes."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]  # type: ignore[misc]


def weigh_(tensors: Sequence[torch.Tensor], weight: float | None = None) -> None:
    """Scale this rank's gradient by its share of the global batch (``batch_weight()``; 1.0 on even steps).

    A rank that holds no samples (weight 0) contributes zeros: its gradient may be NaN
    (the mean of an empty loss), so it is zeroed rather than multiplied.
    """
    w = batch_weight() if weight is None else weight
    if w == 1.0:
        return
    for t in tensors:
        t.zero_() if w == 0 else t.mul_(w)


@torch.no_grad()
def average_gradients_(params: Sequence[torch.Tensor], comm: Comm, compression: Any = None) -> None:
    """Replace every ``.grad`` by the global mean gradient, weighted by each rank's share of the batch.

    Collective. With a compressor its ``average_`` moves the bytes (key ``"grad"``).
    """
    grads = fill_missing_grads(params)
    weigh_(grads)
    if compression is None:
        comm.all_reduce_(grads)
    else:
        compression.average_(grads, comm, key="grad")


__all__ = ["average_gradients_", "fill_missing_grads", "weigh_"]
