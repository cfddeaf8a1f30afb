"""Exact distributed evaluation: each sample counted once, every metric equal to one process's.

``data`` is cut into batches of ``batch_size`` exactly as one process would cut it, and
each worker takes a contiguous block of whole batches (no padding, no duplicates). Every
sample's output is then computed in the same batch as in one process, bit for bit, so the
float64 sums, and the metrics reduced across workers, equal the single-process ones exactly.

The model evaluated is rank 0's (the one ``px.save`` writes), lent to every worker for the
evaluation (:func:`main_replica`): BatchNorm statistics and the replicas of local strategies
(LocalSGD, DiLoCo, EASGD between syncs) differ per worker. The user's module runs directly
(not a DDP wrapper), so workers with different numbers of batches never meet in a
collective, and no DataLoader is created, so evaluation draws nothing from the RNG: training
with or without validation gives the same weights.

Example:
    >>> import torch, torch.nn.functional as F
    >>> from phalanx.group.collectives import Comm
    >>> from phalanx.train.evaluation import evaluate_share
    >>> from phalanx.train.metrics import MeanLoss
    >>> data = torch.utils.data.TensorDataset(torch.ones(10, 3), torch.zeros(10))
    >>> net = torch.nn.Linear(3, 1)
    >>> [m] = evaluate_share(net, [MeanLoss(F.l1_loss)], data, 4, Comm(), lambda b: ([b[0]], b[1][:, None]))
    >>> m.samples
    10
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence, Sized

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset, default_collate

from .. import check
from ..group import group
from ..group.collectives import Comm
from ..errors import ConfigError, usage
from .metrics import Metric


def check_eval(data: Any, batch_size: Any, data_name: str, batch_name: str) -> None:
    """Refuse what cannot be split exactly: a non-positive batch size, a dataset without ``len()``."""
    check.positive_int(batch_name, batch_size, f"Pass e.g. {batch_name}=256.")
    if not isinstance(data, Sized):
        raise ConfigError(usage(f"{data_name} of type {type(data).__name__} without len()", "a map-style dataset",
                                "Wrap tensors in torch.utils.data.TensorDataset."))


def fetch(data: Dataset, indices: range) -> Any:
    """One batch of ``data`` at ``indices``; tensors are sliced directly when possible."""
    if isinstance(data, TensorDataset):
        return tuple(t[indices.start:indices.stop] for t in data.tensors)
    return default_collate([data[i] for i in indices])


@contextlib.contextmanager
def main_replica(module: nn.Module, comm: Comm) -> Iterator[None]:
    """Lend rank 0's parameters and buffers to this worker's ``module``, then give its own back (collective)."""
    if group.world_size() == 1:
        yield
        return
    tensors = [t.data for t in module.state_dict(keep_vars=True).values()]
    own = [t.clone() for t in tensors] if group.rank() != 0 else []
    comm.broadcast_(tensors, src=0)
    try:
        yield
    finally:
        for t, mine in zip(tensors, own):
            t.copy_(mine)


def evaluate_share(module: nn.Module, metrics: Sequence[Metric], data: Dataset, batch_size: int, comm: Comm,
                   to_device: Callable[[Any], tuple[list[Any], torch.Tensor]]) -> list[Metric]:
    """This worker's share of ``data`` through rank 0's ``module``, into ``metrics`` (not yet reduced).

    Collective (rank 0's weights are broadcast); reduce the metrics with
    :func:`phalanx.train.metrics.reduce_all`. ``to_device`` turns a batch into ``(inputs, target)``.
    """
    n, rank, world = len(data), group.rank(), group.world_size()
    batches = -(-n // batch_size)
    first, last = batches * rank // world, batches * (rank + 1) // world
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), main_replica(module, comm):
            for b in range(first, last):
                inputs, target = to_device(fetch(data, range(b * batch_size, min((b + 1) * batch_size, n))))
                output = module(*inputs)
                for m in metrics:
                    m.update(output, target)
    finally:
        module.train(was_training)
    return list(metrics)


__all__ = ["check_eval", "evaluate_share", "fetch", "main_replica"]
