"""Compressors: send fewer bytes per exchange, keep what was not sent.

A compressor is an object with Horovod's two methods plus one collective:

* ``compress(t, key) -> (payload, ctx)`` and ``decompress(payload, ctx) -> t`` for one tensor;
* ``average_(tensors, comm, key)``: replace every tensor by the workers' mean of what
  they transmitted, with whatever collectives the payload needs (an all-reduce for
  dense payloads, an all-gather for sparse ones, two all-reduces for PowerSGD).

Error feedback (Seide et al. 2014; Karimireddy et al. 2019): what a lossy compressor
leaves out of a tensor stays in a local residual, keyed by ``key``, and is added to
the next tensor under the same key, so nothing is lost, only delayed. A compressor's
state comes in two parts, kept apart here and nowhere else: ``state_dict()`` is what every
worker shares (PowerSGD's warm-start Q), ``replica_state_dict()`` is this worker's own (the
residuals). A worker that joins, or resumes on another world size, takes rank 0's shared part
and starts with zero residuals: taking rank 0's would count its error feedback twice.

Pass a compressor to ``px.AllReduce(compression=...)`` (gradients) or
``px.DiLoCo(compression=...)`` (the pseudo-gradient). Bytes go through
:class:`phalanx.Comm`, so ``strategy.bytes_sent`` counts the compressed sizes.

Example:
    >>> import torch, phalanx as px
    >>> c = px.TopK(0.25)
    >>> payload, ctx = c.compress(torch.tensor([0.1, -3.0, 0.2, 1.0]))
    >>> c.decompress(payload, ctx)
    tensor([ 0., -3.,  0.,  0.])
    >>> c.residuals["t"]
    tensor([0.1000, 0.0000, 0.2000, 1.0000])
"""
from __future__ import annotations

import math
import warnings
import zlib
from typing import Any, Sequence

import torch

from .. import check
from ..group.collectives import Comm, scatter_back
from ..errors import ConfigError, usage

Payload = Any
Context = Any


class Compressor:
    """Base class: override ``compress`` and ``decompress``; ``average_`` all-reduces the payload.

    The default ``average_`` suits dense payloads whose mean is the mean of the
    tensors (a cast, a quantiser with a shared scale). Sparse payloads override it.
    """

    def compress(self, tensor: torch.Tensor, key: str = "t") -> tuple[Payload, Context]:
        raise NotImplementedError

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        raise NotImplementedError

    def average_(self, tensors: Sequence[torch.Tensor], comm: Comm, key: str = "grad") -> None:
        flat = _flatten(tensors)
        payload, ctx = self.compress(flat, key)
        comm.all_reduce_([payload], op="mean")
        scatter_back(self.decompress(payload, ctx), tensors)

    def state_dict(self) -> dict[str, Any]:
        """The state every worker shares (the same on every rank): what a joiner takes from rank 0."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; this worker's own state is left as it is."""

    def replica_state_dict(self) -> dict[str, Any]:
        """This worker's own state (error-feedback residuals): never sent to another worker."""
        return {}

    def load_replica_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`replica_state_dict` returned on this worker."""

    def reset(self) -> None:
        """Forget what is kept between rounds (residuals, warm starts): both parts loaded empty."""
        self.load_state_dict({})
        self.load_replica_state_dict({})

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def check_compressor(value: Any, owner: str) -> "Compressor | None":
    """None or a compressor object; anything else is a usage error naming ``owner``."""
    if value is None or isinstance(value, Compressor):
        return value
    if isinstance(value, type) and issubclass(value, Compressor):
        raise ConfigError(usage(f"{owner}(compression={value.__name__})", "a compressor object",
                                f"Instantiate it: compression=px.{value.__name__}(...)."))
    raise ConfigError(usage(f"{owner}(compression={value!r})", "None or a compressor object "
                            "(px.FP16(), px.TopK(ratio), px.Threshold(tau), px.PowerSGD(rank), px.Quantize(bits), "
                            "px.SparseLoCo(), or a px.Compressor subclass)",
                            "Pass one of those, or leave compression unset."))


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) != 1 else tensors[0].reshape(-1).clone()


class FP16(Compressor):
    """Half-precision transport: 2 bytes per value instead of 4.

    Bound: every value with ``|x| <= 65504`` comes back with ``|x' - x| <= 2**-11 * |x| + 2**-25``
    (round to nearest; the second term covers subnormals). Larger values overflow to inf, as in
    DDP's ``fp16_compress_hook``. Values are divided by the world size before the sum, so
    the sum itself stays in range. No error feedback: the loss is at rounding level.
    """

    def compress(self, tensor: torch.Tensor, key: str = "t") -> tuple[Payload, Context]:
        return tensor.to(torch.float16), tensor.dtype

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        return payload.to(ctx)

    def average_(self, tensors: Sequence[torch.Tensor], comm: Comm, key: str = "grad") -> None:
        flat = _flatten(tensors)
        payload, ctx = self.compress(flat.div_(comm.world_size), key)
        comm.all_reduce_([payload], op="sum")
        scatter_back(self.decompress(payload, ctx), tensors)


class _ErrorFeedback(Compressor):
    """Keeps one residual per key: what was not transmitted is added to the next tensor."""

    def __init__(self, error_feedback: bool = True) -> None:
        self.error_feedback = bool(error_feedback)
        self.residuals: dict[str, torch.Tensor] = {}

    def _corrected(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """``tensor`` plus the residual kept under ``key``, as a buffer the caller may change.

        Under error feedback this *is* the residual's buffer: the caller subtracts what
        it sends, in place, and what is left is the next residual (no extra copies).
        """
        dtype = tensor.dtype if tensor.dtype in (torch.float32, torch.float64) else torch.float32
        if not self.error_feedback:
            return tensor.detach().to(dtype, copy=True)
        residual = self.residuals.get(key)
        if residual is None:
            residual = self.residuals[key] = tensor.detach().to(dtype, copy=True).contiguous()
        elif residual.shape != tensor.shape:
            raise ConfigError(usage(f"a tensor of shape {tuple(tensor.shape)} under key {key!r}",
                                    f"the shape {tuple(residual.shape)} its residual was kept for",
                                    "Use one key per tensor (or per fixed list of tensors)."))
        else:
            residual.add_(tensor.detach())
        return residual

    def replica_state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_replica_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}


class _Sparse(_ErrorFeedback):
    """Values and their indices; workers' payloads differ in support, so they are all-gathered."""

    _variable = False  # does the payload's length differ between workers?

    def _select(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError  # indices of the entries to send

    def compress(self, tensor: torch.Tensor, key: str = "t") -> tuple[Payload, Context]:
        flat = self._corrected(tensor, key).view(-1)
        idx = self._select(flat)
        values = flat[idx]
        flat[idx] = 0  # what is not sent stays behind as the residual
        index_dtype = torch.int32 if tensor.numel() < 2**31 else torch.int64
        return (values, idx.to(index_dtype)), (tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        (values, idx), (shape, dtype) = payload, ctx
        out = torch.zeros(math.prod(shape), dtype=values.dtype, device=values.device)
        out.index_add_(0, idx.long(), values)
        return out.view(shape).to(dtype)

    def average_(self, tensors: Sequence[torch.Tensor], comm: Comm, key: str = "grad") -> None:
        flat = _flatten(tensors)
        (values, idx), ctx = self.compress(flat, key)
        if comm.world_size == 1:
            scatter_back(self.decompress((values, idx), ctx), tensors)
            return
        # One message per worker: values then indices, as raw bytes, padded to the longest.
        # Padding is (value 0, index 0), which adds nothing.
        count = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
        longest = int(max(int(c) for c in comm.all_gather(count))) if self._variable else values.numel()
        pad = max(longest, 1) - values.numel()
        values = torch.cat([values, values.new_zeros(pad)])
        idx = torch.cat([idx, idx.new_zeros(pad)])
        gathered = comm.all_gather(torch.cat([values.view(torch.uint8), idx.view(torch.uint8)]))
        split = values.numel() * values.element_size()
        total = torch.zeros_like(flat, dtype=values.dtype)
        for message in gathered:  # rank order: every worker adds in the same order, replicas stay identical
            total.index_add_(0, message[split:].view(idx.dtype).long(), message[:split].view(values.dtype))
        scatter_back(total.div_(comm.world_size).to(flat.dtype), tensors)


class TopK(_Sparse):
    """Send the ``ceil(ratio * n)`` largest-magnitude entries (with error feedback).

    Bound (one round trip, empty residual): the entries sent are exact and
    ``||x - x'||^2 <= (1 - k/n) * ||x||^2`` with ``k = ceil(ratio * n)``.
    Costs 8 bytes per sent entry (value and int32 index), so ratios above 0.5 send
    more than the dense tensor. On a list of tensors, ``average_`` selects over their
    concatenation (global top-k); error feedback lets every layer's turn come.
    """

    def __init__(self, ratio: float, *, error_feedback: bool = True) -> None:
        super().__init__(error_feedback)
        ratio = check.fraction("TopK(ratio", ratio, "Pass the share of entries to send, e.g. TopK(0.01).", close=")")
        if ratio > 0.5:
            warnings.warn(f"TopK(ratio={ratio}) sends values and indices for more than half the entries, which "
                          "is more bytes than the dense tensor; use px.AllReduce() or px.FP16() instead.",
                          stacklevel=2)
        self.ratio = float(ratio)

    def _select(self, flat: torch.Tensor) -> torch.Tensor:
        n = flat.numel()
        k = min(n, max(1, math.ceil(self.ratio * n)))
        magnitude = flat.abs()
        if n >= 1 << 16 and 4 * k < n:
            # A full top-k over millions of entries is slow on CPU. Estimate a threshold from an
            # evenly strided sample (aiming at 2k candidates), then take the exact top-k of the
            # candidates; if the estimate caught fewer than k, fall back. The result is exact.
            sample = magnitude[::max(1, n // 20_000)]
            floor = sample.topk(max(1, math.ceil(2 * k / n * sample.numel())), sorted=False).values.min()
            candidates = (magnitude >= floor).nonzero().squeeze(1)
            if candidates.numel() >= k:
                return candidates[magnitude[candidates].topk(k, sorted=False).indices]
        return magnitude.topk(k, sorted=False).indices

    def __repr__(self) -> str:
        return f"TopK({self.ratio})"


class Threshold(_Sparse):
    """Send the entries with ``|x| >= tau`` (with error feedback): the rest stays local.

    This is the "send only what passes a threshold, keep the rest" rule from the Platoon
    discussion (Strom 2015). Bound (one round trip, empty residual): entries sent are exact
    and every other entry has ``|x - x'| = |x| < tau``. The number sent varies, so workers
    first exchange their counts (8 bytes) and pad to the longest.
    """

    _variable = True

    def __init__(self, tau: float, *, error_feedback: bool = True) -> None:
        super().__init__(error_feedback)
        self.tau = check.positive_float("Threshold(tau", tau, "Pass the smallest |value| worth sending, "
                                        "e.g. Threshold(1e-3).", close=")")

    def _select(self, flat: torch.Tensor) -> torch.Tensor:
        return (flat.abs() >= self.tau).nonzero().squeeze(1)

    def __repr__(self) -> str:
        return f"Threshold({self.tau})"


class PowerSGD(_ErrorFeedback):
    """Rank-``r`` gradient approximation by one power iteration, with error feedback and warm start.

    Vogels, Karimireddy and Jaggi 2019 ("PowerSGD", Algorithm 1): each tensor of two or
    more dimensions is viewed as an ``n x m`` matrix ``M`` (plus its residual);
    ``P = M Q`` is all-reduced and orthogonalised, ``Q = M^T P`` is all-reduced, and
    ``P Q^T`` replaces ``M``. ``Q`` is kept as the next step's starting point (warm
    start), so the approximation keeps improving on slowly changing gradients. Vectors
    and matrices too small to gain travel dense in the first all-reduce. Two
    all-reduces per exchange, ``(n + m) * r`` values per matrix instead of ``n * m``.

    Bound (one round trip): ``P P^T M`` is an orthogonal projection, so
    ``||M - M'||_F <= ||M||_F``; a matrix of rank <= r comes back exact, and repeated
    warm-started calls on one matrix converge to the best rank-r approximation (SVD).
    """

    def __init__(self, rank: int = 4, *, error_feedback: bool = True, seed: int = 0) -> None:
        super().__init__(error_feedback)
        rank = check.positive_int("PowerSGD(rank", rank, "Pass the approximation's rank, e.g. PowerSGD(rank=4).",
                                  close=")")
        self.rank, self.seed = rank, int(seed)
        self.qs: dict[str, torch.Tensor] = {}  # warm start (Q^T), identical on every worker

    def _compressible(self, t: torch.Tensor) -> bool:
        if t.dim() < 2:
            return False
        n, m = t.shape[0], t.numel() // t.shape[0]
        return (n + m) * self.rank < n * m

    # Q is kept transposed (r x m, contiguous): thin products run ~10x faster on CPU that way.
    def _qt(self, key: str, m: int, like: torch.Tensor) -> torch.Tensor:
        qt = self.qs.get(key)
        if qt is None or qt.shape != (self.rank, m):
            # Same seed on every worker, so P = M Q is linear across workers from the first step.
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(key.encode()))
            qt = torch.randn(self.rank, m, generator=gen).to(like)
        return qt

    def _factors(self, m: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Orthogonalise P, then Q^T = P^T M (this worker's)."""
        p = torch.linalg.qr(p).Q  # orthonormal columns: the same on every worker once P is averaged
        return p, p.t() @ m

    def _leave_error(self, m: torch.Tensor, p: torch.Tensor, qt_local: torch.Tensor) -> None:
        if self.error_feedback:  # M becomes M - P Q_local^T in place: the local error (paper, Algorithm 2)
            m.addmm_(p, qt_local, alpha=-1)

    def _round(self, tensors: Sequence[torch.Tensor], comm: Comm, key: str) -> None:
        keys = [f"{key}.{i}" for i in range(len(tensors))]
        mats = {i: self._corrected(t, keys[i]).view(t.shape[0], -1) for i, t in enumerate(tensors)
                if self._compressible(t)}
        dense = [t for i, t in enumerate(tensors) if i not in mats]
        ps = [m @ self._qt(keys[i], m.shape[1], m).t() for i, m in mats.items()]
        comm.all_reduce_(dense + ps)  # one collective: the vectors ride along with the P matrices
        factors = [self._factors(m, p) for m, p in zip(mats.values(), ps, strict=True)]
        for m, (p, qt) in zip(mats.values(), factors, strict=True):
            self._leave_error(m, p, qt)
        comm.all_reduce_([qt for _, qt in factors])
        for (i, _), (p, qt) in zip(mats.items(), factors, strict=True):
            self.qs[keys[i]] = qt  # warm start for the next round, identical on every worker
            t = tensors[i]
            if t.dtype == p.dtype and t.is_contiguous():
                torch.mm(p, qt, out=t.view(t.shape[0], -1))
            else:
                t.copy_((p @ qt).view(t.shape))

    def compress(self, tensor: torch.Tensor, key: str = "t") -> tuple[Payload, Context]:
        """Payload ``(P, Q)``: P (n x r) orthonormal, Q (m x r); the tensor is ``P Q^T``."""
        if not self._compressible(tensor):
            return tensor.detach().clone(), None
        m = self._corrected(tensor, key).view(tensor.shape[0], -1)
        p, qt = self._factors(m, m @ self._qt(key, m.shape[1], m).t())
        self._leave_error(m, p, qt)
        self.qs[key] = qt.clone()
        return (p, qt.t()), (tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> torch.Tensor:
        if ctx is None:
            return payload
        (p, q), (shape, dtype) = payload, ctx
        return (p @ q.t()).view(shape).to(dtype)

    def average_(self, tensors: Sequence[torch.Tensor], comm: Comm, key: str = "grad") -> None:
        with torch.no_grad():
            self._round(tensors, comm, key)

    def state_dict(self) -> dict[str, Any]:
        return {"qs": {k: v.clone() for k, v in self.qs.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Files written before the split also hold "residuals" here (rank 0's): they are not this worker's.
        self.qs = {k: v.clone() for k, v in state.get("qs", {}).items()}

    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank})"


__all__ = ["Compressor", "FP16", "PowerSGD", "Threshold", "TopK", "check_compressor"]
