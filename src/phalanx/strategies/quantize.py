"""Block quantisation for exchanges: int8 or packed 4-bit values with one scale per block.

``px.Quantize(bits=4, block=128)`` is a compressor (:mod:`phalanx.strategies.compression`): it
flattens any tensor, pads it to whole blocks, and sends each block as ``bits``-bit
integers in ``[-q, q]`` (``q = 2**(bits-1) - 1``: 127 or 7) times one float32 scale,
``scale = max|x| / q`` over the block. Four-bit values travel two to a byte. Rounding
is to the nearest level or stochastic (unbiased: ``E[x'] = x``), as the papers do
(INTELLECT-1 sends int8 pseudo-gradients; Streaming DiLoCo, arXiv 2501.18512, 4-bit).

Bound (round to nearest, one round trip, empty residual): every value comes back within
half a level of its block, ``|x - x'| <= max|block| / (2q)``; stochastic rounding within
one level. With ``error_feedback=True`` what rounding left out is added to the next tensor
under the same key (:mod:`phalanx.strategies.compression`).

A sum of quantised values is not a quantised value, so the exchange is not an
all-reduce: each worker all-gathers every worker's packed bytes and scales (plus the
weight of its contribution, one float) and adds the dequantised messages locally, in
rank order, so every worker gets the same bits (as OpenDiLoCo and INTELLECT-1 do). Bytes
on the wire per worker and exchange: ``ceil(n / block) * (block * bits / 8 + 4) + 4`` (whole
blocks: the last one is padded; one float32 scale per block; one float32 weight).

Values near float32's maximum: a scale is capped where ``q * scale`` is still finite (a block
holding ``3.4e38`` comes back finite, within half a level plus one float32 rounding), and the mean
of the workers' messages weighs each by its share before adding, so it never overflows where
the values themselves do not.

Example:
    >>> import torch, phalanx as px
    >>> q = px.Quantize(bits=8, block=4)
    >>> x = torch.tensor([1.0, -0.5, 0.25, 0.0, 3.0])
    >>> payload, ctx = q.compress(x)
    >>> (q.decompress(payload, ctx) - x).abs().max().item() <= 3.0 / 254
    True
    >>> q.message_bytes(5)   # 8 bytes of values, 2 scales, 1 weight
    20
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .. import check
from ..group import group
from ..group.collectives import Comm, scatter_back
from ..group.guard import guarded, wait_watched
from .compression import Context, Payload, _ErrorFeedback, _flatten
from ..errors import ConfigError, usage

ROUNDINGS = ("nearest", "stochastic")


def check_floating(tensor: torch.Tensor, owner: str) -> None:
    """Refuse an integer or boolean tensor: quantising it would change its values."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        raise ConfigError(usage(f"{owner} of a {tensor.dtype} tensor of shape {tuple(tensor.shape)}",
                                "a floating-point tensor (parameters, gradients, pseudo-gradients)",
                                "Leave integer buffers (counters, indices) out of the quantised exchange."))


@dataclass
class Pending:
    """An exchange in flight: wait() gives the weighted mean (a flat float32 tensor of ``numel`` values).

    ``message`` is exactly what this worker sent: sending it again (after a regroup) redoes
    this worker's part of the exchange bit for bit.
    """

    quantize: "Gathered"
    message: torch.Tensor
    numel: int
    comm: Comm
    gathered: list[torch.Tensor] | None = None
    work: Any = None

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        with guarded("the quantised all-gather"):
            wait_watched(self.work, "the quantised all-gather")  # ends once a peer is known gone
        self.comm.stats.seconds += time.perf_counter() - start
        return self.quantize.sum_messages(self.gathered or [self.message], self.numel)


class Gathered(_ErrorFeedback):
    """A compressor whose message is one uint8 tensor of a size fixed by ``numel``: all-gathered, then added
    locally in rank order (every worker gets the same bits). :class:`Quantize` and :class:`phalanx.SparseLoCo`.

    A subclass gives ``message_bytes(numel)``, ``encode(tensor, key, weight)`` (the message, the weight inside it)
    and ``sum_messages(messages, numel)`` (the weighted mean, flat float32); sending, the asynchronous exchange
    (:meth:`send`, used by ``px.StreamingDiLoCo`` to overlap it) and ``average_`` are shared.

    Example:
        >>> import phalanx as px
        >>> isinstance(px.Quantize(4), Gathered), isinstance(px.SparseLoCo(), Gathered)
        (True, True)
    """

    def message_bytes(self, numel: int) -> int:
        raise NotImplementedError

    def encode(self, tensor: torch.Tensor, key: str = "t", weight: float = 1.0) -> torch.Tensor:
        raise NotImplementedError

    def sum_messages(self, messages: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
        raise NotImplementedError

    def send(self, message: torch.Tensor, numel: int, comm: Comm) -> Pending:
        """Start all-gathering ``message`` (asynchronously); the bytes are counted now."""
        pending = Pending(self, message, numel, comm)
        if comm.world_size > 1:
            pending.gathered = [torch.empty_like(message) for _ in range(comm.world_size)]
            with guarded("the quantised all-gather"):
                # over comm's own group (a sharded model's "replicate" group), not the default one
                pending.work = dist.all_gather(pending.gathered, message, group=comm.process_group, async_op=True)
            comm.record(message.numel() * message.element_size())
        return pending

    def start_mean(self, tensors: Sequence[torch.Tensor], comm: Comm, key: str = "grad",
                   weight: float = 1.0) -> Pending:
        """Encode ``tensors`` (as one flat vector) and start the exchange; ``weight``: this worker's share."""
        flat = _flatten(tensors)
        return self.send(self.encode(flat, key, weight), flat.numel(), comm)

    def average_(self, tensors: Sequence[torch.Tensor], comm: Comm, key: str = "grad") -> None:
        with torch.no_grad():
            mean = self.start_mean(tensors, comm, key).wait()
            scatter_back(mean, tensors)


def _max_scale(levels: int) -> float:
    """The largest float32 scale whose ``levels`` multiple is finite in float32."""
    scale = torch.tensor(torch.finfo(torch.float32).max / levels, dtype=torch.float32)
    while not torch.isfinite(scale * levels):
        scale = torch.nextafter(scale, torch.zeros_like(scale))
    return float(scale)


class Quantize(Gathered):
    """int8 or 4-bit block quantisation (a compressor); see the module docstring.

    Args:
        bits: 8 or 4.
        block: values per scale (even; 64-256 are usual: a smaller block bounds the error
            tighter and costs ``32 / block`` more bits per value).
        rounding: "nearest" or "stochastic" (unbiased; seeded, identical runs repeat).
        error_feedback: keep what rounding left out and add it to the next tensor under the
            same key (Seide et al. 2014); off by default, as the papers send pseudo-gradients
            without it.
        seed: the stochastic rounding's generator seed (offset by the worker's rank at first use).
    """

    def __init__(self, bits: int = 8, *, block: int = 128, rounding: str = "nearest",
                 error_feedback: bool = False, seed: int = 0) -> None:
        super().__init__(error_feedback)
        if bits not in (4, 8) or isinstance(bits, bool):
            raise ConfigError(usage(f"Quantize(bits={bits!r})", "4 or 8",
                                    "Pass bits=8 (int8, as INTELLECT-1) or bits=4 (Streaming DiLoCo)."))
        block = check.positive_int("Quantize(block", block, "Pass the values per scale, e.g. block=128.", close=")")
        if block % 2:
            raise ConfigError(usage(f"Quantize(block={block})", "an even block size",
                                    "Pass e.g. block=64 or 128: 4-bit values are packed two to a byte."))
        if rounding not in ROUNDINGS:
            raise ConfigError(usage(f"Quantize(rounding={rounding!r})", "'nearest' or 'stochastic'",
                                    "Pass rounding='nearest' (deterministic) or 'stochastic' (unbiased)."))
        self.bits, self.block, self.rounding, self.seed = int(bits), block, rounding, int(seed)
        self.levels = 2 ** (self.bits - 1) - 1  # symmetric: -q..q, so 0 is exact and the sign costs nothing
        self._scale_cap = _max_scale(self.levels)
        self._gen: torch.Generator | None = None
        self._unpacked: dict[torch.device, torch.Tensor] = {}  # per device: each byte's two levels (int16)

    # -- one tensor ---------------------------------------------------------------------------------------------
    def _blocks(self, numel: int) -> int:
        return max(1, math.ceil(numel / self.block))

    def message_bytes(self, numel: int) -> int:
        """Bytes one worker sends for ``numel`` values: packed values, float32 scales, one float32 weight."""
        return self._blocks(numel) * self.block * self.bits // 8 + 4 * self._blocks(numel) + 4

    def _round(self, scaled: torch.Tensor) -> torch.Tensor:
        if self.rounding == "nearest":
            return scaled.round_()
        if self._gen is None or self._gen.device != scaled.device:
            # the rank offsets the stream: the workers' rounding errors must be independent
            self._gen = torch.Generator(device=scaled.device).manual_seed(self.seed * 1_000_003 + group.rank())
        noise = torch.rand(scaled.shape, generator=self._gen, device=scaled.device, dtype=scaled.dtype)
        return scaled.add_(noise).floor_()

    def encode(self, tensor: torch.Tensor, key: str = "t", weight: float = 1.0) -> torch.Tensor:
        """This worker's message for ``tensor``: packed values, scales and ``weight``, as one uint8 tensor."""
        check_floating(tensor, "Quantize")
        corrected = self._corrected(tensor, key)
        flat = corrected.reshape(-1).to(torch.float32)
        n, nblocks = flat.numel(), self._blocks(flat.numel())
        blocks = torch.empty(nblocks * self.block, dtype=torch.float32, device=flat.device)
        blocks[:n] = flat
        blocks[n:] = 0  # the last block's padding only
        blocks = blocks.view(nblocks, self.block)  # our own copy: scaled and rounded in place below
        # (torch.aminmax was slower here on CPU); capped so that levels x scale stays finite near float32's max
        scales = (blocks.abs().amax(dim=1) / self.levels).clamp_(max=self._scale_cap)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = self._round(blocks.div_(safe[:, None])).clamp_(-self.levels, self.levels)
        if self.error_feedback:  # what was not sent stays behind in the residual (the corrected buffer)
            corrected.reshape(-1).sub_((q * scales[:, None]).reshape(-1)[:n].to(corrected.dtype))
        if self.bits == 8:
            values = q.to(torch.int8).view(torch.uint8).reshape(-1)
        else:  # two to a byte, low nibble first, each level + 8 (1..15): 16·high + low, exact in float32, then
            pairs = q.view(-1, 2)  # one conversion of half the values (a float-to-byte cast is this path's cost)
            values = torch.add(pairs[:, 0], pairs[:, 1], alpha=16.0).add_(136.0).to(torch.uint8)
        w = torch.tensor([float(weight)], dtype=torch.float32, device=flat.device)
        # the float32 parts first: a view as float32 needs a 4-byte aligned offset
        return torch.cat([scales.view(torch.uint8), w.view(torch.uint8), values])

    def decode(self, message: torch.Tensor, numel: int) -> tuple[torch.Tensor, float]:
        """The values (flat float32, ``numel``) and the weight one worker's message carries.

        Layout: ``ceil(numel / block)`` float32 scales, the float32 weight, then the packed values.
        """
        nblocks = self._blocks(numel)
        head = message[:4 * nblocks + 4].view(torch.float32)
        scales, weight, values = head[:nblocks], float(head[nblocks]), message[4 * nblocks + 4:]
        q = self._levels(values, nblocks).to(torch.float32)
        return (q * scales[:, None]).reshape(-1)[:numel], weight

    def compress(self, tensor: torch.Tensor, key: str = "t") -> tuple[Payload, Context]:
        """Payload: the packed message (uint8); context: the tensor's shape and dtype."""
        return self.encode(tensor, key), (tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        shape, dtype = ctx
        return self.decode(payload, math.prod(shape))[0].view(shape).to(dtype)

    # -- the exchange ---------------------------------------------------------------------------------------------
    def sum_messages(self, messages: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
        """The weighted mean of the workers' messages, added in rank order (the same bits on every worker).

        Each message is added as ``levels x (scale x weight)`` in one pass (``addcmul_``), without
        materialising its dequantised values: this runs once per exchange on the critical path.
        """
        nblocks = self._blocks(numel)
        total = torch.zeros(nblocks, self.block, dtype=torch.float32, device=messages[0].device)
        heads = [message[:4 * nblocks + 4].view(torch.float32) for message in messages]
        weights = sum(float(head[nblocks]) for head in heads)
        for message, head in zip(messages, heads, strict=True):
            weight = float(head[nblocks])
            if weight:  # each weighed by its share first: the sum of values near float32's max would overflow
                total.addcmul_(self._levels(message[4 * nblocks + 4:], nblocks),
                               (head[:nblocks] * (weight / weights))[:, None])
        return total.view(-1)[:numel]

    def _levels(self, values: torch.Tensor, nblocks: int) -> torch.Tensor:
        """The packed values as int8 levels in [-q, q], one row per block (int8: the sum converts them inside its
        multiply, cheaper than reading float32 levels from memory)."""
        if self.bits == 8:
            return values.view(torch.int8).view(nblocks, self.block)
        # a table of each byte's two levels (low nibble first) as one int16: one gather per byte, twice as fast
        # here as two bitwise passes writing every other byte
        table = self._unpacked.get(values.device)
        if table is None:
            pairs = [[(b & 15) - 8, (b >> 4) - 8] for b in range(256)]
            table = torch.tensor(pairs, dtype=torch.int8).view(torch.int16).reshape(-1).to(values.device)
            self._unpacked[values.device] = table
        return table.index_select(0, values.int()).view(torch.int8).view(nblocks, self.block)

    def __repr__(self) -> str:
        extra = "" if self.rounding == "nearest" else f", rounding={self.rounding!r}"
        extra += ", error_feedback=True" if self.error_feedback else ""
        return f"Quantize(bits={self.bits}, block={self.block}{extra})"


__all__ = ["Gathered", "Pending", "Quantize", "check_floating"]
