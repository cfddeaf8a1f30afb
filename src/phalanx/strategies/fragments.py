"""Streaming DiLoCo's fragments: the parameters cut into consecutive parts balanced by bytes, and each part's state.

:class:`Fragment` holds what one fragment carries between its outer steps (anchor, outer momentum, schedule
offset, the exchange in flight); :func:`balanced_split` cuts the parameters into fragments
(:mod:`.streaming_diloco` uses both).

Example:
    >>> balanced_split([32, 8, 16, 2], 2)
    [range(0, 1), range(1, 4)]
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from .buffers import BufferMean
from .diloco import _outer_dtype


def balanced_split(sizes: list[int], parts: int) -> list[range]:
    """``parts`` consecutive, non-empty index ranges over ``sizes`` whose sums are as equal as the cuts allow.

    Example:
        >>> balanced_split([32, 8, 16, 2], 2)
        [range(0, 1), range(1, 4)]
    """
    cum = list(itertools.accumulate(sizes))
    total, cuts = cum[-1] if cum else 0, [0]
    for k in range(1, parts):
        lo, hi = cuts[-1] + 1, len(sizes) - (parts - k)
        cuts.append(min(range(lo, hi + 1), key=lambda c: abs(cum[c - 1] - total * k / parts)))
    cuts.append(len(sizes))
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def buffers_by_fragment(model: nn.Module, split: list[range]) -> list[list[torch.Tensor]]:
    """Each module's buffers go with the fragment of its first trainable parameter (none: the first fragment)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    owner = {id(trainable[j]): i for i, idx in enumerate(split) for j in idx}
    out: list[list[torch.Tensor]] = [[] for _ in split]
    seen: set[int] = set()
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        for b in module.buffers(recurse=False):
            if id(b) not in seen:
                seen.add(id(b))
                out[owner[id(own[0])] if own else 0].append(b)
    return out


class Fragment:
    """One fragment: its parameters, anchor and outer momentum, its schedule offset and its exchange in flight."""

    def __init__(self, index: int, params: list[nn.Parameter], offset: int) -> None:
        self.index, self.params, self.offset = index, params, offset
        self.anchor = [p.detach().to(_outer_dtype(p), copy=True) for p in params]
        self.momentum = [torch.zeros_like(a) for a in self.anchor]
        self.share = 0.0  # this replica's samples since the fragment's last send, in batch weights
        self.sent_at = -1  # the step its exchange in flight was sent at; -1: none
        self.synced_at = 0  # the last step after which every replica held the anchor (an apply with mixing 0)
        self.message: torch.Tensor | None = None  # what this worker sent (re-sent after a regroup)
        self.result: list[torch.Tensor] | None = None  # the average, once known on every worker
        self.pending: Any = None  # the collective's handle (a future, or a quantize.Pending)
        self.buffer: torch.Tensor | None = None  # the all-reduce's own copy of the message (summed in place)
        self.resend = False  # a regroup or restore dropped the handle: send the message again
        self.eager: list[torch.Tensor] | None = None  # mixing="eager": the weights right after the eager step
        self.moments_sent: list[torch.Tensor] | None = None  # moments=: this worker's optimizer states as sent
        self.moment_steps = 0  # optimizer steps taken since the send (the states' decay since)
        self.running_stats = BufferMean(())  # the buffers of the modules whose parameters it holds

    @property
    def numel(self) -> int:
        return sum(a.numel() for a in self.anchor)


__all__ = ["Fragment", "balanced_split", "buffers_by_fragment"]
