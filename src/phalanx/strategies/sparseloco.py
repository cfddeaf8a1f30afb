"""SparseLoCo: chunked top-k of the pseudo-gradient plus residual, 2-bit values, error feedback for outer momentum.

Sarfi, Thérien, Lidin and Belilovsky 2025 ("Communication Efficient LLM Pre-training with SparseLoCo",
arXiv 2508.15706). Each worker keeps an error-feedback accumulator ``e`` per key; at an outer step, with
``Δ`` its pseudo-gradient:

* ``e ← β·e + Δ`` (``decay`` = β: the accumulator stands in for DiLoCo's outer momentum);
* the flat ``e`` is cut into chunks of ``chunk`` values (the last one padded with zeros) and in each chunk
  the ``topk`` entries of largest magnitude are kept;
* the kept values are quantised to 2 bits: levels ``{-1, -1/3, 1/3, 1} × s`` with ``s`` the chunk's
  largest kept magnitude (one float32 per chunk), round to nearest;
* ``Δ̂`` is what those bits say (zero elsewhere) and ``e ← e - Δ̂``: the residual is exactly what was not sent;
* the workers all-gather their messages and add them in rank order, weighted by their shares (the plain
  mean ``(1/R)·Σ Δ̂_r`` for equal shares), and the outer step is ``θ ← θ - α·mean``, with no momentum.

So pass it to ``px.DiLoCo`` or ``px.StreamingDiLoCo``; their outer learning rate and momentum default to
this compressor's ``outer_lr = 1.0`` and ``outer_momentum = 0.0`` (explicit values are kept).

Message per worker and exchange, for ``n`` values, ``C = ceil(n / chunk)`` chunks and
``b = ceil(log2(chunk))`` index bits: ``4·C + 4 + ceil(2·C·k / 8) + ceil(b·C·k / 8)`` bytes (scales,
the weight, 2-bit values, b-bit in-chunk indices, each packed tight). With the defaults (chunk 4096,
k 64: 1.56% of the entries, 12-bit indices) that is 116 bytes per 4096 values against 16384 in float32:
141× fewer per exchange, and ``every`` times that per step.

The residuals are this worker's own state (``replica_state_dict``: checkpointed with each worker's part,
restored by each survivor after an elastic rollback); a joiner, a restore onto another world size, and every
rank after a regroup of a sharded model (``px.DiLoCo`` on ``shard=``: a residual is one rank's flat vector over
its old rows, chunked for that layout) start with empty residuals (what was not sent yet is dropped).

Example:
    >>> import torch, phalanx as px
    >>> c = px.SparseLoCo(topk=2, chunk=8)
    >>> x = torch.tensor([0.1, -3.0, 0.2, 1.0, 0.0, 0.0, 0.0, 0.0])
    >>> c.decompress(*c.compress(x)).tolist()
    [0.0, -3.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    >>> c.residuals["t"].tolist()
    [0.10000000149011612, 0.0, 0.20000000298023224, 0.0, 0.0, 0.0, 0.0, 0.0]
    >>> c.message_bytes(8)   # 1 scale, the weight, 4 bits of values, 6 bits of indices
    10
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from .. import check
from ..errors import ConfigError, usage
from .compression import Context, Payload
from .quantize import Gathered, _max_scale, check_floating

BITS = 2  # per kept value
LEVELS = (-1.0, -1 / 3, 1 / 3, 1.0)  # x the chunk's scale; symmetric, so a kept value's sign always survives


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers below ``2**bits`` packed tight, low bit first, into ``ceil(len·bits/8)`` bytes.

    Example:
        >>> pack_bits(torch.tensor([1, 2, 3, 0]), 2).tolist()   # 0b00_11_10_01
        [57]
    """
    shifts = torch.arange(bits, device=codes.device)
    flat = ((codes.reshape(-1, 1).long() >> shifts) & 1).to(torch.uint8).reshape(-1)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 8)]).view(-1, 8)
    return (flat << torch.arange(8, dtype=torch.uint8, device=codes.device)).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The ``count`` integers :func:`pack_bits` packed (int64).

    Example:
        >>> unpack_bits(torch.tensor([57], dtype=torch.uint8), 2, 4).tolist()
        [1, 2, 3, 0]
    """
    flat = (packed.reshape(-1, 1) >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1
    flat = flat.reshape(-1)[:count * bits].view(count, bits).long()
    return (flat << torch.arange(bits, device=packed.device)).sum(1)


class SparseLoCo(Gathered):
    """Chunked top-k with 2-bit values and decayed error feedback (a compressor); see the module docstring.

    Args:
        topk: entries kept per chunk (k; 64 of 4096 is 1.56%, as Covenant-72B sends).
        chunk: values per chunk (the top-k is taken within each; indices cost ``ceil(log2(chunk))`` bits).
        decay: β, the error-feedback accumulator's decay in [0, 1] (it replaces the outer momentum).

    Example:
        >>> import phalanx as px
        >>> s = px.DiLoCo(every=16, compression=px.SparseLoCo())
        >>> s.exchange.lr, s.exchange.momentum, s.compression
        (1.0, 0.0, SparseLoCo(topk=64, chunk=4096, decay=0.95))
    """

    outer_lr = 1.0  # the rule's defaults where this compressor is used: the accumulator is the momentum
    outer_momentum = 0.0

    def __init__(self, topk: int = 64, *, chunk: int = 4096, decay: float = 0.95) -> None:
        super().__init__(error_feedback=True)
        self.chunk = check.positive_int("SparseLoCo(chunk", chunk, "Pass the values per chunk, e.g. chunk=4096.",
                                        close=")")
        self.topk = check.positive_int("SparseLoCo(topk", topk, "Pass the entries kept per chunk, e.g. topk=64.",
                                       close=")")
        if self.topk > self.chunk:
            raise ConfigError(usage(f"SparseLoCo(topk={self.topk}, chunk={self.chunk})", "topk <= chunk",
                                    f"Pass topk={self.chunk} or fewer (64 of 4096 is 1.56%)."))
        self.decay = check.number("SparseLoCo(decay", decay, "Pass β in [0, 1], e.g. decay=0.95.", low=0, high=1,
                                  low_open=False, high_open=False, close=")")
        self.index_bits = max(1, (self.chunk - 1).bit_length())
        self._scale_cap = _max_scale(1)  # the largest level is 1 x scale: any finite scale decodes finite
        self._levels = torch.tensor(LEVELS, dtype=torch.float32)

    def _chunks(self, numel: int) -> int:
        return max(1, math.ceil(numel / self.chunk))

    def message_bytes(self, numel: int) -> int:
        """Bytes one worker sends for ``numel`` values: scales, the weight, packed values and packed indices."""
        chunks = self._chunks(numel)
        kept = chunks * self.topk
        return 4 * chunks + 4 + math.ceil(BITS * kept / 8) + math.ceil(self.index_bits * kept / 8)

    def _corrected(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        residual = self.residuals.get(key)
        if residual is not None and residual.shape == tensor.shape:
            residual.mul_(self.decay)  # e <- β e (+ Δ, below)
        return super()._corrected(tensor, key)

    def _values(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """What 2-bit ``codes`` (chunks x k) say, in float32: one expression, for the residual and the receiver."""
        return self._levels.to(scales.device)[codes] * scales[:, None]

    def encode(self, tensor: torch.Tensor, key: str = "t", weight: float = 1.0) -> torch.Tensor:
        """This worker's message for ``tensor`` (plus its accumulator): one uint8 tensor; the residual is kept."""
        check_floating(tensor, "SparseLoCo")
        acc = self._corrected(tensor, key)  # the accumulator's own buffer: what is sent is taken out in place
        flat = acc.reshape(-1)
        n, chunks = flat.numel(), self._chunks(flat.numel())
        padded = torch.zeros(chunks * self.chunk, dtype=torch.float32, device=flat.device)
        padded[:n] = flat
        padded = padded.view(chunks, self.chunk)
        idx = padded.abs().topk(self.topk, dim=1, sorted=False).indices  # (chunks, k)
        kept = padded.gather(1, idx)
        scales = kept.abs().amax(dim=1).clamp_(max=self._scale_cap)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        # nearest of the four levels: (x/s + 1) * 1.5 maps -1, -1/3, 1/3, 1 to 0, 1, 2, 3
        codes = kept.div_(safe[:, None]).add_(1).mul_(1.5).round_().clamp_(0, 3).long()
        sent = torch.zeros_like(padded).scatter_(1, idx, self._values(codes, scales))
        flat.sub_(sent.view(-1)[:n].to(flat.dtype))  # e <- e - Δ̂: the residual is what was not sent
        w = torch.tensor([float(weight)], dtype=torch.float32, device=flat.device)
        # the float32 parts first: a view as float32 needs a 4-byte aligned offset
        return torch.cat([scales.view(torch.uint8), w.view(torch.uint8), pack_bits(codes, BITS),
                          pack_bits(idx, self.index_bits)])

    def _parts(self, message: torch.Tensor, numel: int) -> tuple[torch.Tensor, float, torch.Tensor, torch.Tensor]:
        """Scales, weight, 2-bit codes (chunks x k) and in-chunk indices (chunks x k) of one message."""
        chunks = self._chunks(numel)
        kept = chunks * self.topk
        head = message[:4 * chunks + 4].view(torch.float32)
        values_at = 4 * chunks + 4
        index_at = values_at + math.ceil(BITS * kept / 8)
        codes = unpack_bits(message[values_at:index_at], BITS, kept).view(chunks, self.topk)
        idx = unpack_bits(message[index_at:], self.index_bits, kept).view(chunks, self.topk)
        return head[:chunks], float(head[chunks]), codes, idx

    def sum_messages(self, messages: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
        """The weighted mean of the workers' sparse messages, added in rank order (the same bits everywhere)."""
        chunks = self._chunks(numel)
        total = torch.zeros(chunks, self.chunk, dtype=torch.float32, device=messages[0].device)
        parts = [self._parts(m, numel) for m in messages]
        weights = sum(weight for _, weight, _, _ in parts)
        for scales, weight, codes, idx in parts:
            if weight:  # weighed by its share before adding: a sum near float32's max would overflow
                values = self._values(codes, scales) * (weight / weights)
                total.scatter_add_(1, idx, values)  # indices are distinct within one message
        return total.view(-1)[:numel]

    def compress(self, tensor: torch.Tensor, key: str = "t") -> tuple[Payload, Context]:
        """Payload: the packed message (uint8); context: the tensor's shape and dtype."""
        return self.encode(tensor, key), (tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        shape, dtype = ctx
        return self.sum_messages([payload], math.prod(shape)).view(shape).to(dtype)

    def __repr__(self) -> str:
        return f"SparseLoCo(topk={self.topk}, chunk={self.chunk}, decay={self.decay:g})"


def outer_defaults(compression: Any, outer_lr: float | None, outer_momentum: float | None,
                   lr: float = 0.7, momentum: float = 0.9) -> tuple[float, float]:
    """A rule's outer learning rate and momentum: those given, else the compressor's (SparseLoCo: 1 and 0), else
    DiLoCo's (0.7 and 0.9).

    Example:
        >>> outer_defaults(SparseLoCo(), None, None), outer_defaults(None, None, 0.5)
        ((1.0, 0.0), (0.7, 0.5))
    """
    return (getattr(compression, "outer_lr", lr) if outer_lr is None else outer_lr,
            getattr(compression, "outer_momentum", momentum) if outer_momentum is None else outer_momentum)


__all__ = ["SparseLoCo", "outer_defaults", "pack_bits", "unpack_bits"]
