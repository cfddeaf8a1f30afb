"""Synchronous gradient averaging: the default strategy.

N workers with batch b each compute exactly what one process computes with batch
N·b: the mean loss's gradient is the mean of the workers' mean-loss gradients.
We reuse PyTorch's C++ DDP reducer, which overlaps bucketed all-reduce with the
backward pass (Li et al. 2020), and choose its bucket size from the model instead
of DDP's fixed 25 MB.

With ``px.Quantize`` (int8 or 4-bit) each bucket is quantised and sent as soon as its
gradients are ready, overlapping backward as the uncompressed buckets do
(:class:`~phalanx.strategies.overlap.OverlappedMean`): on a slow link the exchange of the
early buckets hides behind the rest of backward. Other compressors average the gradients
once per step, at the end of ``backward()``, in one batched exchange over the whole model
(``compressor.average_``) rather than through a DDP comm hook per bucket: PowerSGD then
costs two collectives per step instead of two per bucket, and its warm-start matrices are
keyed by parameter (DDP rebuilds its buckets after the first step, which would scramble
bucket-keyed state); those exchanges do not overlap backward.

Where DDP's reducer cannot act (under ``phalanx run --elastic``, where a joiner attaches
alone; a Keras model, whose ``train_step`` calls the model itself) the uncompressed
average still overlaps backward: :class:`~phalanx.strategies.overlap.OverlappedMean`
sends buckets from per-parameter hooks, with no DDP wrapper.

Either way the average is in ``.grad`` when ``backward()`` returns, so gradient
clipping and ``GradScaler``'s inf check see it, as with DDP.

Example:
    >>> import torch, phalanx as px
    >>> model, opt = px.wrap(torch.nn.Linear(2, 1), torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), 0.1),
    ...                      strategy=px.AllReduce())
"""
from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..group import group
from ..group.records import Record, Slot
from ..group.collectives import Comm
from ..group.guard import guarded
from .compression import check_compressor
from ..errors import ConfigError, usage
from .. import check
from .accounting import Accounting
from .base import StepState, Strategy, compressor_replica_state, device_of, load_compressor_replica_state
from .gradients import average_gradients_
from .overlap import OverlappedMean
from .quantize import Quantize


def fitted_bucket_mb(model: nn.Module, buckets: int = 4, floor_mb: float = 1.0, cap_mb: float = 25.0) -> float:
    """A bucket size that splits the gradients into about ``buckets`` pieces.

    One huge bucket cannot start reducing until backward is over; many tiny ones pay
    the per-message latency many times. A handful of buckets lets the first ones
    travel while backward still runs.
    """
    total_mb = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20
    return float(min(cap_mb, max(floor_mb, total_mb / buckets)))


#: Who may rebuild this group with workers that attached alone (``None``: nobody; ``phalanx.elastic`` sets itself
#: when it takes the worker's place). Its gradient averaging must then follow the default group wherever it goes.
REBUILT: "Record[Slot[str]]" = Record("rebuilt with joiners", Slot)


def rebuilt(g: group.Group) -> bool:
    """True when ``g`` may be rebuilt with workers that attached alone (:data:`REBUILT` is set).

    Example:
        >>> import phalanx as px
        >>> rebuilt(px.init())   # not under `phalanx run --elastic`
        False
    """
    return REBUILT.of(g).value is not None


def averager(*, sharded: bool, compressed: bool, quantised: bool, world_size: int, rebuilt: bool,
             wrapper: bool) -> str:
    """Which of :class:`AllReduce`'s four gradient averagers a model gets, decided from explicit facts.

    - ``"sharded"``: FSDP's reduce-scatter (and all-reduce across replica groups, HSDP) averages; nothing added.
    - ``"after_backward"``: a compressor (not quantised) exchanges in ``after_backward``; a group of one that is
      never rebuilt is plain PyTorch, bit for bit.
    - ``"overlapped"``: bucketed hooks that follow the default group (:class:`OverlappedMean`): a group that may be
      rebuilt with joiners that attached alone (a DDP reducer would keep the old group's buckets), a quantised
      (asynchronous) exchange, or a caller that runs the model itself (``wrapper=False``, ``px.keras.wrap``).
    - ``"ddp"``: torch's ``DistributedDataParallel`` with the guarded mean as its comm hook.

    Example:
        >>> averager(sharded=False, compressed=False, quantised=False, world_size=4, rebuilt=False, wrapper=True)
        'ddp'
        >>> averager(sharded=False, compressed=False, quantised=False, world_size=1, rebuilt=True, wrapper=True)
        'overlapped'
    """
    if sharded:
        return "sharded"
    if (compressed and not quantised) or (world_size == 1 and not rebuilt):
        return "after_backward"
    if not wrapper or rebuilt or quantised:
        return "overlapped"
    return "ddp"


class AllReduce(Accounting, StepState, Strategy):
    """Average gradients every step, by the end of ``backward()``.

    Args:
        compression: a compressor object (``px.FP16()``, ``px.PowerSGD(rank=4)``...) or None.
        bucket_mb: gradient bucket size; by default fitted to the model.

    Each rank's gradient is weighted by its share of the global batch as backward
    accumulates it (the step clock's ``weight``, :mod:`phalanx.step.clock`), so an uneven last
    batch, and uneven micro-batches under ``px.no_sync``, give one process's gradient.
    """

    name = "allreduce"
    uneven_batches = True  # each rank's gradient is weighted by its batch share (phalanx.step.clock)
    #: The ``px.FullyShard`` that ``px.wrap(..., shard=...)`` applied (phalanx.sharding.layout sets it), or None.
    sharded_by: Any = None

    def __init__(self, compression: Any = None, *, bucket_mb: float | None = None) -> None:
        super().__init__()
        if bucket_mb is not None:
            check.positive_float("bucket_mb", bucket_mb, "Pass a size in MiB, or leave it unset to fit the model.")
        self.compression = check_compressor(compression, "AllReduce")
        self.bucket_mb = bucket_mb
        self._hook: _GuardedMean | None = None
        self._overlap: OverlappedMean | None = None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, wrapper: bool = True) -> nn.Module:
        """Returns the module to train: a DDP wrapper, or ``model`` itself.

        ``wrapper=False`` is for callers that run ``model`` themselves rather than the module
        returned (``px.keras.wrap``): the average then comes from the overlapped hooks.
        """
        super().attach(model, optimizer)
        fsdp = sys.modules.get("torch.distributed.fsdp")  # imported by px.FullyShard only (a 1 s import)
        chosen = averager(  # an elastic joiner's model is sharded when it enters; a joiner attaches alone
            sharded=(fsdp is not None and isinstance(model, fsdp.FSDPModule)) or self.sharded_by is not None,
            compressed=self.compression is not None, quantised=isinstance(self.compression, Quantize),
            world_size=self.comm.world_size, rebuilt=rebuilt(group.current()), wrapper=wrapper)
        if chosen in ("sharded", "after_backward"):
            return model
        bucket_bytes = int((self.bucket_mb or fitted_bucket_mb(model)) * 2**20)
        if chosen == "overlapped":
            self._overlap = OverlappedMean(self.params, self.comm, bucket_bytes=bucket_bytes,
                                           syncing=self.clock.syncing, compression=self.compression)
            return model
        device_ids = [device_of(model)] if device_of(model).type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_bytes / 2**20,
                                      **_NO_FORWARD_BUFFER_SYNC,  # BatchNorm statistics stay per worker
                                      gradient_as_bucket_view=True)
        self._hook = _GuardedMean(self.comm)
        ddp.register_comm_hook(self._hook, guarded_mean_hook)  # torch's way: the hook's per-step data is its state
        return ddp

    def weighs_gradients(self, step: int) -> bool:
        return True

    def _reduce_unreached(self, missed: list[nn.Parameter]) -> None:
        """This pass left ``missed`` without a gradient here: let DDP's reducer finish as one process would.

        DDP (without ``find_unused_parameters``) waits for a gradient of every parameter: its
        bucket holding ``missed`` never starts, a peer that reached them waits on it, and the
        next forward fails ("Expected to have finished reduction in the prior iteration").
        A zero gradient sent through autograd (a second, tiny backward pass from the
        parameters themselves) marks them ready, so every bucket goes out and pairs with the
        peers'; this rank's share of the batch did not touch them, so zeros are its true
        contribution to the batch-weighted mean. No cost on a step where every parameter was
        reached, unlike ``find_unused_parameters=True``'s graph walk and extra all-reduce.

        A parameter that had no gradient here and averages to exactly zero was, save a
        coincidence of exact zeros on every rank that reached it, reached by no rank: it gets
        ``.grad = None`` back, so the optimizer skips it, as in one process.
        """
        fresh = [p for p in missed if p.grad is None]
        with self.clock.backward.paused():  # no second end-of-backward callback for this pass
            torch.autograd.backward(missed, [torch.zeros_like(p) for p in missed])
        for p in fresh:
            if p.grad is not None and not bool(p.grad.any()):
                p.grad = None

    def after_backward(self, step: int) -> None:
        if self._hook is not None:  # DDP's reducer averaged the buckets; it runs before this callback
            if len(self.clock.reached) < len(self.params):
                self._reduce_unreached([p for p in self.params if id(p) not in self.clock.reached])
            calls, self._hook.calls = self._hook.calls, 0
            if calls == 0 and self._hook.error is None:
                raise ConfigError(_BYPASSED)
            if self._hook.error is not None:
                err, self._hook.error = self._hook.error, None
                with guarded("the gradient all-reduce in backward"):
                    raise err  # guarded names the lost rank
            return
        if self._overlap is not None:  # the buckets went out during backward; wait for them here
            self._overlap.finish()
        elif self.compression is not None and self.comm.world_size > 1:  # alone, nothing to send: plain torch
            average_gradients_(self.params, self.comm, self.compression)
        else:
            return
        if self.compression is not None and self.comm.world_size > 1 and not bool(torch.stack(
                [torch.isfinite(p.grad).all() for p in self.params if p.grad is not None]).all()):  # one sync
            # inf/nan reached the average (AMP overflow on some rank): the same on every rank, so every
            # GradScaler skips this step; the residuals and warm starts hold it too, and are dropped.
            self.compression.reset()

    def regroup(self) -> None:
        """The group was rebuilt (phalanx.elastic): nothing sent on the old group is awaited any more.

        The overlapped buckets send through the default group, which is the new one, and divide by
        its size; DDP (not used under ``--elastic``) would keep its reducer and comm hook likewise.
        """
        if getattr(self, "_hook", None) is not None:
            self._hook.error = None
        if getattr(self, "_overlap", None) is not None:
            self._overlap.forget_pass()

    def state_dict(self) -> dict[str, Any]:
        # The compressor's shared part (PowerSGD's warm starts) is rank 0's; residuals are per rank.
        return {"compression": self.compression.state_dict()} if self.compression is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "compression" in state:
            self.compression.load_state_dict(state["compression"])

    def replica_state_dict(self) -> dict[str, Any]:
        """This worker's own: its compressor's residuals."""
        return compressor_replica_state(self)

    def load_replica_state_dict(self, state: dict[str, Any]) -> None:
        load_compressor_replica_state(self, state)

    def __repr__(self) -> str:
        return f"AllReduce(compression={self.compression!r})"


class _GuardedMean:
    """State of :func:`guarded_mean_hook`: the group to average over, and a failure kept for ``after_backward``.

    A peer that dies mid-backward makes gloo fail the bucket's future; raised inside
    the reducer, that error would surface from ``loss.backward()`` as a bare RuntimeError.
    Kept here, ``after_backward`` raises it as a WorkerLostError that names the lost rank.
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.error: BaseException | None = None
        self.calls = 0  # buckets averaged since the last end of backward: none means DDP's forward was bypassed

    def failed(self, err: BaseException, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        self.error = self.error or err
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future


# No annotations: DDP checks them by identity, and this module's are strings (PEP 563).
def guarded_mean_hook(state, bucket):  # noqa: ANN001, ANN201
    """DDP comm hook: the bucket's all-reduce and mean over ``state.comm``.

    The gradients in the bucket are already weighted by each rank's batch share (the
    step clock did it as backward accumulated them), so the plain mean is one process's.
    """
    buffer = bucket.buffer()
    state.calls += 1
    try:
        future = state.comm.all_reduce_async(buffer)
    except RuntimeError as err:
        return state.failed(err, buffer)

    def mean(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            return done.value()[0].div_(state.comm.world_size)
        except RuntimeError as err:
            state.error = state.error or err
            return buffer

    return future.then(mean)


# Calling the user's module (or torch.compile of it) instead of the DDP wrapper px.wrap returned skips DDP's
# forward: its reducer then averages nothing and the replicas drift apart silently.
_BYPASSED = usage("a backward pass whose forward bypassed the module px.wrap returned (e.g. torch.compile(net) "
                  "or net itself called after px.wrap(net, ...)): no gradient was averaged",
                  "the forward pass through the model px.wrap returned",
                  "Compile first, then wrap: model, opt = px.wrap(torch.compile(net), opt); "
                  "or compile what px.wrap returned: model = torch.compile(model).")

# torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers and deprecated the old name; torch 2.11
# has only the old one. Either way buffers are not synced at forward (attach already broadcast them once).
_NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                           if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
                           else {"broadcast_buffers": False})

