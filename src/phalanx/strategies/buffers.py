"""Running statistics at a sync: what a periodic rule averages besides the parameters.

A BatchNorm layer's ``running_mean`` and ``running_var`` are buffers, not parameters: no
optimizer and no parameter exchange touches them. Between two syncs each replica tracks
the statistics of its own data under its own weights. A rule that averaged only the
parameters would leave the replicas disagreeing at a sync (``replicas_agree`` would be
false for a BN model) and the model kept at the end with rank 0's statistics beside the
averaged weights. DDP keeps buffers equal by broadcasting rank 0's at every forward; a
periodic rule averages them where it averages the parameters, over the same group.

Averaging does not make the statistics fit the weights: they still lag them, most after an
outer step (measured: ``benchmarks/bn_statistics.py``, ResNet-20 under DiLoCo scores 0.22-0.45
in eval mode against 0.48-0.59 with recomputed statistics). Recompute them before evaluating
(``torch.optim.swa_utils.update_bn``).

Only buffers that changed on some replica since the last average travel: a constant
buffer (a causal mask) costs one flag, not its bytes. The copy that detects a change is
a cache, not state: after a restore it may call an unchanged buffer changed, and the
average of equal values is that value.

Example:
    >>> import torch, phalanx as px
    >>> from phalanx.strategies.buffers import BufferMean
    >>> bn = torch.nn.BatchNorm1d(3)
    >>> means = BufferMean(bn.buffers())
    >>> [tuple(b.shape) for b in means.buffers]      # num_batches_tracked is an integer: never averaged
    [(3,), (3,)]
"""
from __future__ import annotations

from typing import Iterable

import torch

from ..group.collectives import Comm


class BufferMean:
    """Average the floating-point buffers among ``buffers`` over ``comm`` where some replica changed them."""

    def __init__(self, buffers: Iterable[torch.Tensor]) -> None:
        self.buffers = [b for b in buffers if b.is_floating_point()]
        self.seen = [b.detach().clone() for b in self.buffers]

    @torch.no_grad()
    def average_(self, comm: Comm) -> None:
        """Collective on ``comm`` when any floating-point buffer exists (every replica holds the same list)."""
        if not self.buffers or comm.world_size == 1:
            return
        changed = torch.tensor([0.0 if torch.equal(b, s) else 1.0 for b, s in zip(self.buffers, self.seen)],
                               device=self.buffers[0].device)
        comm.all_reduce_([changed], op="sum")  # one flag each: a buffer changed on any replica moves everywhere
        moved = [b for b, flag in zip(self.buffers, changed.tolist()) if flag]
        if moved:
            comm.all_reduce_(moved)  # all_reduce_ writes the mean back into the tensors: they are the buffers
        for b, s in zip(self.buffers, self.seen):
            s.copy_(b)


__all__ = ["BufferMean"]
