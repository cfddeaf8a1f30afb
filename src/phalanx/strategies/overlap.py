"""Gradient averaging that overlaps backward, with no DDP wrapper: buckets sent as gradients become ready.

DDP's reducer overlaps its bucketed all-reduce with the backward pass, but it acts
only on a forward pass through the DDP module. Where phalanx cannot use it (a Keras
model, whose ``train_step`` calls the model itself; an elastic group, where a joiner
attaches alone) this does the same from public hooks:

* every parameter gets ``Tensor.register_post_accumulate_grad_hook``; when its
  ``.grad`` is complete the hook copies it into its bucket's flat buffer, divided by
  the world size, so that the buckets' sum is the global mean (the step clock already
  weighted each backward pass's gradient by this rank's batch share, :mod:`phalanx.step.clock`);
* the buckets are fixed once, from the parameter list in reverse registration order
  (roughly the order backward produces gradients), split by size and dtype/device.
  The list is the same on every rank, because the model is (``px.wrap`` checks);
* a full bucket is sent with ``Comm.all_reduce_async`` (bytes accounted), but
  only once every bucket before it has been sent: hooks may fire in a different
  order on different ranks, and gloo pairs collectives by the order they start, so
  buckets always start in index order (as DDP's reducer does);
* at the end of backward (:meth:`finish`, from the strategy's ``after_backward``) the
  buckets that never filled (a parameter that got no gradient in this pass) are
  sent with zeros in its place (``px.fill_missing_grads``), every future is awaited,
  and each ``.grad`` holds the average (on CPU copied back into autograd's own
  tensor; elsewhere a view of its bucket, DDP's ``gradient_as_bucket_view``), so
  clipping and ``GradScaler`` see the average when ``backward()`` returns. A
  parameter that no rank reached keeps ``.grad = None``, as in one process (each
  bucket carries one flag per parameter for this), so momentum and weight decay skip
  it there too.

With ``compression=px.Quantize(...)`` each full bucket's gradients are quantised and their
all-gather started at once, as the uncompressed buckets are (DDP runs its compression hooks per
bucket the same way); the 0/1 flags are summed exactly in one small all-reduce at the end of
backward, since a quantised flag beside large gradients could round to zero. Error feedback
keeps one residual per bucket.

Under ``px.no_sync(model)`` the hooks do nothing: only the pass that ends the step
communicates. A failed collective is kept and raised by :meth:`finish` as a
``WorkerLostError`` naming the lost rank.

Example:
    >>> import torch
    >>> from phalanx.group.collectives import Comm
    >>> from phalanx.strategies.overlap import OverlappedMean
    >>> net = torch.nn.Linear(3, 2)
    >>> mean = OverlappedMean(list(net.parameters()), Comm(), bucket_bytes=2**20)
    >>> net(torch.ones(4, 3)).sum().backward(); mean.finish()   # a group of one: the mean of one
    >>> net.bias.grad.tolist()
    [4.0, 4.0]
    >>> len(mean.buckets)
    1
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from ..group.collectives import Comm
from ..group.guard import InFlight, guarded
from .quantize import Pending, Quantize
from ..group.spans import span


class Bucket:
    """Consecutive parameters sharing one flat buffer; ``slots[i]`` is ``params[i]``'s part of it.

    After the gradients, one more element per parameter says whether this rank had a
    gradient for it: summed with the rest, it tells every rank which parameters no rank
    reached, and those keep ``.grad = None`` as in one process (the optimizer skips them).
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        n = sum(p.numel() for p in params)
        self.flat = torch.zeros(n + len(params), dtype=params[0].dtype, device=params[0].device)
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        self.slots = [self.flat[a:b].view(p.shape) for p, a, b in zip(params, offsets, offsets[1:], strict=False)]
        self.grads, self.had_grad = self.flat[:n], self.flat[n:]
        self.reached = [0.0] * len(params)  # this pass's flags, written into had_grad in one op when sent
        self.ready = [False] * len(params)
        self.waiting = len(params)  # parameters whose gradient has not arrived in this pass
        self.future: InFlight | Pending | None = None  # Pending: a quantised exchange

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.waiting, self.future = len(self.params), None

    def take(self, i: int, grad: torch.Tensor | None, scale: float) -> None:
        """Put ``scale`` times parameter ``i``'s gradient into the buffer (None: it got none, so zeros).

        Scaling while copying saves a second pass over the gradient.
        """
        slot = self.slots[i]
        if grad is None:
            slot.zero_()
            self.reached[i] = 0.0
        else:
            if grad.data_ptr() == slot.data_ptr():  # the .grad is our view already (accumulated in place)
                if scale != 1:
                    slot.mul_(scale)
            elif scale != 1:
                torch.mul(grad, scale, out=slot)
            else:
                slot.copy_(grad)
            self.reached[i] = 1.0
        self.ready[i] = True
        self.waiting -= 1

    def seal(self) -> None:
        """Every parameter is in: write the flags (one op; a tensor store per parameter cost more than the copy)."""
        self.had_grad.copy_(torch.tensor(self.reached, dtype=self.had_grad.dtype))


def plan_buckets(params: Sequence[torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """Buckets of about ``bucket_bytes``, in reverse registration order, one dtype/device each (deterministic)."""
    open_: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    done: list[list[torch.Tensor]] = []
    for p in reversed(list(params)):
        key = (p.dtype, p.device)
        members = open_.setdefault(key, [])
        members.append(p)
        if sum(q.numel() * q.element_size() for q in members) >= bucket_bytes:
            done.append(open_.pop(key))
    done.extend(m for m in open_.values() if m)
    return [Bucket(m) for m in done]


class OverlappedMean:
    """The batch-weighted mean gradient, sent bucket by bucket while backward runs.

    Args:
        params: the trainable parameters (the same list, in the same order, on every rank).
        comm: the strategy's :class:`~phalanx.group.collectives.Comm` (the default group; after an elastic
            rebuild, the new one: call :meth:`forget_pass`).
        bucket_bytes: the bucket size.
        syncing: False while gradients only accumulate (``px.no_sync``): the hooks then do nothing.
        compression: None (float all-reduce) or a :class:`~phalanx.strategies.quantize.Quantize`, whose
            exchange is asynchronous (see the module docstring).
    """

    def __init__(self, params: Sequence[torch.Tensor], comm: Comm, *, bucket_bytes: int,
                 syncing: Callable[[], bool] = lambda: True, compression: Quantize | None = None) -> None:
        self.comm, self.syncing, self.compression = comm, syncing, compression
        self.buckets = plan_buckets([p for p in params if p.requires_grad], bucket_bytes)
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                         for b in self.buckets for p in b.params]
        self._sent = 0  # buckets started in this pass; always a prefix of self.buckets
        self.error: BaseException | None = None

    def _on_grad(self, param: torch.Tensor) -> None:
        # Runs once per parameter per step, inside backward: kept to a few attribute reads.
        if not self.syncing():
            return
        bucket, i = self._where[id(param)]
        if bucket.ready[i]:  # twice in one pass cannot happen; a pass that never finished is reset by forget_pass()
            return
        bucket.take(i, param.grad, self._scale())
        if bucket.waiting == 0:
            buckets = self.buckets
            while self._sent < len(buckets) and buckets[self._sent].waiting == 0:
                self._send(buckets[self._sent])

    def _send(self, bucket: Bucket) -> None:
        self._sent += 1
        bucket.seal()
        if self.error is not None:  # this rank cannot take part any more; finish() reports it
            return
        if self.comm.world_size == 1:
            return
        try:
            if self.compression is None:
                bucket.future = self.comm.all_reduce_async(bucket.flat)
            else:
                with span("phalanx/bucket"):  # buckets are sent in index order: _sent names this one
                    bucket.future = self.compression.start_mean([bucket.grads], self.comm,
                                                                key=f"bucket{self._sent - 1}")
        except RuntimeError as err:  # raised here it would leave backward as a bare error; finish() names the rank
            self.error = err

    def finish(self) -> None:
        """End of backward: send what did not fill, wait for every bucket, point each ``.grad`` at its average."""
        try:
            for bucket in self.buckets[self._sent:]:
                for i, p in enumerate(bucket.params):
                    if not bucket.ready[i]:  # no gradient in this pass: what it holds (accumulated), or zeros
                        bucket.take(i, p.grad, self._scale())
                self._send(bucket)
            if self.compression is None:
                self._wait_sums()
            else:
                self._wait_quantised()
            for bucket in self.buckets:
                reached = bucket.had_grad.tolist()
                for p, slot, somewhere in zip(bucket.params, bucket.slots, reached, strict=True):
                    if somewhere > 0:  # some rank had a gradient: the mean, with zeros for those that had none
                        _set_grad(p, slot)
        finally:
            self.forget_pass()

    def _scale(self) -> float:
        # the float buckets are summed, so each rank sends its part of the mean; a quantised exchange is a mean
        return 1.0 / self.comm.world_size if self.compression is None else 1.0

    def _wait_sums(self) -> None:
        start = time.perf_counter()
        what = "the gradient all-reduce in backward"
        with guarded(what):
            if self.error is not None:
                raise self.error
            for bucket in self.buckets:
                if bucket.future is not None:
                    bucket.future.wait(what)
        self.comm.stats.seconds += time.perf_counter() - start  # the communication backward did not hide

    def _wait_quantised(self) -> None:
        with guarded("the quantised gradient exchange in backward"):  # names a lost rank (WorkerLostError)
            if self.error is not None:
                raise self.error
            for bucket in self.buckets:  # Pending.wait and all_reduce_ time themselves
                if bucket.future is not None:
                    bucket.grads.copy_(bucket.future.wait())
            self.comm.all_reduce_([b.had_grad for b in self.buckets], op="sum")  # exact: which some rank reached

    def forget_pass(self) -> None:
        """Forget this pass (after every pass, after a failure, or once the elastic group was rebuilt): nothing old
        is awaited. Not ``regroup``: that name is a rule's reaction to a rebuilt group (elastic.rule.Regroupable)."""
        for bucket in self.buckets:
            bucket.reset()
        self._sent, self.error = 0, None

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for h in self._handles:
            h.remove()
        self._handles = []


def _set_grad(p: torch.Tensor, slot: torch.Tensor) -> None:
    if p.grad is not None and p.grad.data_ptr() == slot.data_ptr():
        return  # already the view
    if p.grad is not None and (slot.device.type == "cpu" or not p.is_contiguous()):
        # On CPU the average goes back into autograd's own .grad. A .grad that is a view of the bucket (DDP's
        # gradient_as_bucket_view) made the next backward slower by 3-10 ms of CPU on ResNet-20 once the user's
        # zero_grad() set it to None (measured, one process, no collectives; 65 copies back cost 0.17 ms).
        # channels_last and the like keep their own layout the same way.
        p.grad.copy_(slot)
    elif p.is_contiguous():
        p.grad = slot  # a view of the bucket: no copy (the next pass copies in, or accumulates in place)
    else:
        p.grad = torch.empty_like(p).copy_(slot)


__all__ = ["Bucket", "OverlappedMean", "plan_buckets"]
