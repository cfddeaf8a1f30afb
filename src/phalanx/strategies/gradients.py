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

from ..group.collectives import Comm


def fill_missing_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every parameter's ``.grad``; one that got none in this pass gets zeros, so every rank sends the same shapes."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]  # type: ignore[misc]


def local_grads(params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """What this rank sends: every ``.grad``, zeros (new tensors, not assigned) where a parameter has none,
    and one flag per parameter, 1 where it had a gradient, in the gradients' dtype so it travels with them."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flags = torch.tensor([p.grad is not None for p in params], dtype=grads[0].dtype, device=grads[0].device)
    return grads, flags


@torch.no_grad()
def set_averaged_grads_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], flags: torch.Tensor) -> None:
    """Point each ``.grad`` at its average; a parameter that no rank reached (summed flag 0) keeps ``None``.

    torch's optimizers skip a parameter whose ``.grad`` is None, so momentum and weight
    decay leave it alone there, as in one process; one that some ranks reached gets the
    average, those that had nothing counting as zeros (their share of the batch did not
    touch it).
    """
    for p, g, somewhere in zip(params, grads, flags.tolist(), strict=True):
        p.grad = g if somewhere > 0 else None


@torch.no_grad()
def average_gradients_(params: Sequence[torch.Tensor], comm: Comm, compression: Any = None) -> None:
    """Replace every ``.grad`` by the global mean gradient; a parameter no rank reached keeps ``None``.

    Each rank's gradient is already weighted by its share of the batch as backward
    accumulated it (:mod:`phalanx.step.clock`), so the plain mean is one process's gradient.
    Collective. With a compressor its ``average_`` moves the gradients (key ``"grad"``) and
    the flags follow in one small all-reduce; without one they ride in the same message.
    """
    grads, flags = local_grads(params)
    if compression is None:
        comm.all_reduce_([*grads, flags])
    else:
        compression.average_(grads, comm, key="grad")
        comm.all_reduce_([flags])
    set_averaged_grads_(params, grads, flags)


@torch.no_grad()
def share_weighted_mean_(tensors: Sequence[torch.Tensor], comm: Comm, share: float) -> None:
    """Replace ``tensors`` by their mean over the ranks, each rank weighted by its ``share`` of the samples.

    Collective, one message (the shares ride with the tensors). Equal shares give the plain
    mean; a rank with share 0 (it held no samples) contributes nothing, not even a NaN.
    """
    if comm.world_size == 1:
        return
    for t in tensors:
        t.zero_() if share == 0 else t.mul_(share)
    total = torch.tensor([float(share)], dtype=tensors[0].dtype, device=tensors[0].device)
    comm.all_reduce_([*tensors, total], op="sum")
    for t in tensors:
        t.div_(total)


def share_total(comm: Comm, share: float) -> float:
    """The sum of every rank's share (collective: one scalar), for a weight that must be known before sending."""
    if comm.world_size == 1:
        return float(share)
    total = torch.tensor([float(share)], dtype=torch.float64)
    comm.all_reduce_([total], op="sum")
    return float(total.item())


__all__ = ["average_gradients_", "fill_missing_grads", "local_grads", "set_averaged_grads_", "share_total",
           "share_weighted_mean_"]
