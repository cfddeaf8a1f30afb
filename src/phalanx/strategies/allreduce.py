"""Synchronous gradient averaging: the default strategy.

N workers with batch b each compute exactly what one process computes with batch
N·b: the mean loss's gradient is the mean of the workers' mean-loss gradients.
We reuse PyTorch's C++ DDP reducer, which overlaps bucketed all-reduce with the
backward pass (Li et al. 2020), and choose its bucket size from the model instead
of DDP's fixed 25 MB.

With a compressor the gradients are averaged once per step, just before
``optimizer.step()``, in one batched exchange over the whole model
(``compressor.average_``) rather than through a DDP comm hook per bucket: PowerSGD
then costs two collectives per step instead of two per bucket, the residuals and
warm-start matrices are keyed by parameter (DDP rebuilds its buckets after the
first step, which would scramble bucket-keyed state), and gradient accumulation
works unchanged. The price is no overlap with backward, which matters little on
the slow links compression is for.

Example:
    >>> import torch, phalanx as px
    >>> model, opt = px.wrap(torch.nn.Linear(2, 1), torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), 0.1),
    ...                      strategy=px.AllReduce())
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import group
from ..comm import guarded
from ..compression import check_compressor
from ..errors import ConfigError, usage
from .base import Strategy


def fitted_bucket_mb(model: nn.Module, buckets: int = 4, floor_mb: float = 1.0, cap_mb: float = 25.0) -> float:
    """A bucket size that splits the gradients into about ``buckets`` pieces.

    One huge bucket cannot start reducing until backward is over; many tiny ones pay
    the per-message latency many times. A handful of buckets lets the first ones
    travel while backward still runs.
    """
    total_mb = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20
    return float(min(cap_mb, max(floor_mb, total_mb / buckets)))


class AllReduce(Strategy):
    """Average gradients every step, overlapped with backward.

    Args:
        compression: a compressor object (``px.FP16()``, ``px.PowerSGD(rank=4)``...) or None.
        bucket_mb: gradient bucket size; by default fitted to the model.
    """

    name = "allreduce"

    def __init__(self, compression: Any = None, *, bucket_mb: float | None = None) -> None:
        super().__init__()
        if bucket_mb is not None and not bucket_mb > 0:
            raise ConfigError(usage(f"bucket_mb={bucket_mb!r}", "a positive size in MiB",
                                    "Leave it unset to fit it to the model."))
        self.compression = check_compressor(compression, "AllReduce")
        self.bucket_mb = bucket_mb

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        super().attach(model, optimizer)
        self._grad_bytes = sum(p.numel() * p.element_size() for p in self.params)
        if self.comm.world_size == 1 or self.compression is not None or group.is_elastic():
            # A group of one is plain PyTorch, bit for bit; compression runs in before_step. Elastic: the
            # group may be rebuilt with joiners that attached alone, so every worker averages in before_step.
            return model
        device_ids = [model_device(model)] if model_device(model).type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids,
                                      bucket_cap_mb=self.bucket_mb or fitted_bucket_mb(model),
                                      forward_sync_buffers=False,  # BatchNorm statistics stay per worker
                                      gradient_as_bucket_view=True)
        self._hook = _GuardedMean(self.comm.world_size)
        ddp.register_comm_hook(None, self._hook.hook)
        return ddp

    def before_step(self) -> None:
        hook = getattr(self, "_hook", None)
        if hook is not None and hook.error is not None:
            err, hook.error = hook.error, None
            with guarded("the gradient all-reduce in backward"):
                raise err  # guarded names the lost rank
        if self.compression is not None and self.comm.world_size > 1:  # alone, nothing to send: plain torch
            self.compression.average_(gradients(self.params), self.comm, key="grad")
        elif hook is None and self.comm.world_size > 1:  # elastic (see attach)
            self.comm.all_reduce_(gradients(self.params))

    def after_step(self) -> None:
        super().after_step()
        if self.compression is None and self.comm.world_size > 1:
            self.comm.stats.bytes_sent += self._grad_bytes  # DDP's reducer sent the full gradient

    def regroup(self) -> None:
        """The group was rebuilt (phalanx.elastic): the hook's divisor follows the new size.

        DDP keeps its reducer; its comm hook sends through the default group, which is the new one.
        """
        if getattr(self, "_hook", None) is not None:
            self._hook.world_size, self._hook.error = self.comm.world_size, None

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.compression is not None:
            state["compression"] = self.compression.state_dict()  # rank 0's; see gather_state_dict
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "compression" in state:
            self.compression.load_state_dict(state["compression"])
        self._load_replicas(state)  # each rank's own residuals, when the checkpoint has them

    def __repr__(self) -> str:
        return f"AllReduce(compression={self.compression!r})"


class _GuardedMean:
    """DDP comm hook: the plain bucket all-reduce and mean, keeping a failure for ``before_step``.

    A peer that dies mid-backward makes gloo fail the bucket's future; raised inside
    the reducer, that error would surface from ``loss.backward()`` as a bare RuntimeError.
    Kept here, ``opt.step()`` raises it as a WorkerLostError that names the lost rank.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.error: BaseException | None = None

    # No annotations: DDP checks them by identity, and this module's are strings (PEP 563).
    def hook(self, state, bucket):  # noqa: ANN001, ANN201
        buffer = bucket.buffer()
        try:
            future = dist.all_reduce(buffer, async_op=True).get_future()
        except RuntimeError as err:
            return self._failed(err, buffer)

        def mean(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            try:
                return done.value()[0].div_(self.world_size)
            except RuntimeError as err:
                self.error = self.error or err
                return buffer

        return future.then(mean)

    def _failed(self, err: BaseException, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        self.error = self.error or err
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def gradients(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Every parameter's gradient; a parameter that got none gets zeros, so all workers send the same shapes."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]
