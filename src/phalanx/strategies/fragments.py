"""Streaming DiLoCo's fragments: the parameters cut into consecutive parts, and each part's state.

Two cuts (``StreamingDiLoCo(cut=...)``): :func:`balanced_split` keeps whole tensors, balanced by bytes as the cuts
between tensors allow (the paper's fragments are whole layers); :func:`value_split` cuts the concatenated values into
equal parts, a tensor split between fragments where a cut falls inside it, so a model with one dominant tensor (an
LSTM's recurrent weights, a language model's embedding) still sends equal parts. :class:`Piece` names one tensor's
values a fragment holds; :class:`Fragment` holds what one fragment carries between its outer steps (anchor, outer
momentum, schedule offset, the exchange in flight). :mod:`.streaming_diloco` uses all of them.

Example:
    >>> balanced_split([32, 8, 16, 2], 2)
    [range(0, 1), range(1, 4)]
    >>> [[(p.tensor, p.start, p.stop) for p in f] for f in value_split([32, 8, 16, 2], 2)]
    [[(0, 0, 29)], [(0, 29, 32), (1, 0, 8), (2, 0, 16), (3, 0, 2)]]
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Collection

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


@dataclass(frozen=True)
class Piece:
    """The values ``start:stop`` (in its flat order) of trainable tensor number ``tensor`` that a fragment holds."""

    tensor: int
    start: int
    stop: int


def whole_pieces(sizes: list[int], split: list[range]) -> list[list[Piece]]:
    """:func:`balanced_split`'s ranges of whole tensors as pieces (``sizes``: each tensor's values)."""
    return [[Piece(j, 0, sizes[j]) for j in idx] for idx in split]


def value_split(sizes: list[int], parts: int, whole: Collection[int] = ()) -> list[list[Piece]]:
    """``parts`` consecutive pieces of the concatenated values, of equal size to one value; a cut that falls inside a
    tensor listed in ``whole`` (one that cannot be viewed flat: not contiguous) moves to that tensor's nearer end.
    A fragment left empty by such moves is empty in the result (the caller refuses it).

    Example:
        >>> [[(p.tensor, p.start, p.stop) for p in f] for f in value_split([10, 2], 3)]
        [[(0, 0, 4)], [(0, 4, 8)], [(0, 8, 10), (1, 0, 2)]]
        >>> [[(p.tensor, p.start, p.stop) for p in f] for f in value_split([10, 2], 3, whole={0})]
        [[], [(0, 0, 10)], [(1, 0, 2)]]
    """
    starts = [0, *itertools.accumulate(sizes)]
    total = starts[-1]
    cuts = [0]
    for k in range(1, parts):
        c = (total * k + parts // 2) // parts
        i = next((i for i in range(len(sizes)) if starts[i] < c < starts[i + 1]), None)
        if i is not None and i in whole:
            c = starts[i] if c - starts[i] <= starts[i + 1] - c else starts[i + 1]
        cuts.append(max(c, cuts[-1]))
    cuts.append(total)
    out: list[list[Piece]] = []
    for lo, hi in zip(cuts, cuts[1:]):
        out.append([Piece(i, max(lo, starts[i]) - starts[i], min(hi, starts[i + 1]) - starts[i])
                    for i in range(len(sizes)) if max(lo, starts[i]) < min(hi, starts[i + 1])])
    return out


def piece_view(p: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The tensor itself where the piece is all of it, else a flat view of its values ``start:stop``: writing the
    view writes the parameter (the outer step and the mix copy into it)."""
    if piece.start == 0 and piece.stop == p.numel():
        return p
    return p.detach().view(-1)[piece.start:piece.stop]


def buffers_by_fragment(model: nn.Module, split: list[list[Piece]]) -> list[list[torch.Tensor]]:
    """Each module's buffers go with the fragment of its first trainable parameter's first values (none: the first
    fragment)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    owner: dict[int, int] = {}
    for i, pieces in enumerate(split):
        for piece in pieces:
            owner.setdefault(id(trainable[piece.tensor]), i)
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


__all__ = ["Fragment", "Piece", "balanced_split", "buffers_by_fragment", "piece_view", "value_split", "whole_pieces"]
