"""Metrics that are exact across workers, and a throughput meter that skips warm-up.

A metric keeps *sums* (a small float64 tensor), never averages. Each worker
updates its own sums over its own samples; one all-reduce adds them up; the
value is computed from the totals. So a validation set that does not divide by
the number of workers still counts every sample exactly once, and the result
equals what one process computes over the whole set (float64 sums of float32
values do not depend on the order of addition in practice).

Example:
    >>> import torch
    >>> acc = Accuracy()
    >>> acc.update(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
    >>> acc.reduce().compute()  # a group of one: reduce is a no-op
    0.5
"""
from __future__ import annotations

import copy
import functools
import math
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .. import check
from ..group import group
from ..group.collectives import Comm
from ..errors import ConfigError, usage


class Metric:
    """Base class: float64 ``sums`` that add across workers, and ``compute`` from them.

    Subclasses set ``size`` (the number of sums) and implement :meth:`update`
    and :meth:`compute`.
    """

    name = "metric"
    size = 2

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(self.size, dtype=torch.float64)

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        raise NotImplementedError

    def compute(self) -> float:
        raise NotImplementedError

    def _add(self, *values: torch.Tensor | float) -> None:
        """Add one contribution per sum; tensors stay on their device until the end."""
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                v = v.detach().to(torch.float64)
                if self.sums.device != v.device:
                    self.sums = self.sums.to(v.device)
            self.sums[i] += v

    def reduce(self, comm: Any = None) -> "Metric":
        """Add up every worker's sums (one all-reduce); returns self."""
        reduce_all([self], comm)
        return self

    def fresh(self) -> "Metric":
        """An independent, zeroed copy (the trainer keeps one per use)."""
        clone = copy.deepcopy(self)
        clone.reset()
        return clone

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Accuracy(Metric):
    """Fraction of samples whose top-``top_k`` predictions contain the target.

    Logits of shape (n, classes) use argmax / top-k; a single output column
    (n,) or (n, 1) is read as a binary logit (positive means class 1).
    """

    name = "accuracy"

    def __init__(self, top_k: int = 1) -> None:
        check.positive_int("Accuracy(top_k", top_k, "Use e.g. Accuracy(top_k=5).", close=")")
        self.top_k = top_k
        if top_k != 1:
            self.name = f"top{top_k}_accuracy"
        super().__init__()

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        target = target.view(-1)
        if output.dim() == 1 or output.shape[-1] == 1:
            correct = ((output.reshape(-1) > 0).long() == target).sum()
        elif self.top_k == 1:
            correct = (output.argmax(dim=-1).view(-1) == target).sum()
        else:
            top = output.topk(self.top_k, dim=-1).indices.view(len(target), -1)
            correct = (top == target.unsqueeze(1)).any(dim=1).sum()
        self._add(correct, float(len(target)))

    def compute(self) -> float:
        correct, count = self.sums.tolist()
        return correct / count if count else math.nan

    def __repr__(self) -> str:
        return f"Accuracy(top_k={self.top_k})"


class MeanLoss(Metric):
    """The loss over every sample seen, combined exactly as ``loss_fn`` itself reduces a batch.

    Each batch adds the sum of its unreduced losses and the denominator of the
    loss's own mean: the number of elements, or for cross-entropy / NLL the number
    of targets that are not ``ignore_index`` (padding), or the sum of the class
    weights of the targets when ``weight=`` is given. Sums and denominators add
    across batches and workers, so the result equals ``loss_fn`` over the whole set
    in one call. This works for torch's loss modules (``nn.CrossEntropyLoss(weight=w,
    ignore_index=0)``...), for ``torch.nn.functional`` losses and ``functools.partial``
    of them. Any other callable is taken to be a plain per-sample mean (its batch
    value is weighted by the batch size); pass the torch loss object when yours is
    weighted or ignores padding.

    Example (padding ignored: the mean over the 2 real targets, not over 4):
        >>> import torch
        >>> m = MeanLoss(torch.nn.CrossEntropyLoss(ignore_index=-1))
        >>> m.update(torch.zeros(4, 3), torch.tensor([0, 1, -1, -1]))
        >>> round(m.compute(), 4), m.samples
        (1.0986, 4)
    """

    name = "loss"
    size = 3  # sum of losses, the loss's own denominator, samples

    def __init__(self, loss_fn: Callable[..., torch.Tensor] | None = None) -> None:
        self.loss_fn = loss_fn or nn.functional.cross_entropy
        check_loss(self.loss_fn)
        super().__init__()

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        total, denominator = loss_sum_and_denominator(self.loss_fn, output, target)
        self._add(total, denominator, float(len(target)))

    def compute(self) -> float:
        total, denominator, _ = self.sums.tolist()
        return total / denominator if denominator else math.nan

    @property
    def samples(self) -> int:
        """Samples seen (not the denominator, which counts targets or weights)."""
        return int(self.sums[2].item())

    def __repr__(self) -> str:
        return f"MeanLoss({getattr(self.loss_fn, '__name__', type(self.loss_fn).__name__)})"


_CLASS_LOSSES = (nn.CrossEntropyLoss, nn.NLLLoss)


def check_loss(loss_fn: Callable[..., torch.Tensor]) -> None:
    """Refuse losses whose mean cannot be combined exactly from sums (torch's CTC loss divides by lengths)."""
    if isinstance(loss_fn, nn.CTCLoss) or _function_of(loss_fn)[0] is nn.functional.ctc_loss:
        raise ConfigError(usage("a CTC loss for validation", "a loss whose mean is a sum over a count of elements or "
                                "targets (CTC's divides each sample by its target length first)",
                                "Pass loss_fn with reduction='sum' divided by your own count, or "
                                "nn.CTCLoss(reduction='sum') and compare sums."))


def _function_of(loss_fn: Any) -> tuple[Any, dict[str, Any]]:
    """The function behind ``functools.partial`` wrappers, and their keyword arguments."""
    keywords: dict[str, Any] = {}
    while isinstance(loss_fn, functools.partial):
        keywords = {**loss_fn.keywords, **keywords}
        loss_fn = loss_fn.func
    return loss_fn, keywords


def _class_denominator(losses: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                       ignore_index: int) -> torch.Tensor | float:
    """What torch's cross-entropy / NLL mean divides by: kept targets, or the sum of their class weights."""
    if target.is_floating_point():  # class probabilities: a plain mean over the samples
        return float(losses.numel())
    kept = target != ignore_index
    if weight is None:
        return kept.sum()
    return (weight.to(losses.device)[target.masked_fill(~kept, 0)] * kept).sum()


def batch_denominator(loss_fn: Callable[..., torch.Tensor], output: torch.Tensor, target: torch.Tensor) -> float:
    """The denominator of ``loss_fn``'s mean over this batch, cheaply: kept targets (or their class weights)
    for cross-entropy / NLL, the batch size otherwise. Weighting batch means by it combines them exactly."""
    fn, keywords = _function_of(loss_fn)
    if isinstance(loss_fn, _CLASS_LOSSES):
        weight, ignore = loss_fn.weight, loss_fn.ignore_index
    elif fn in (nn.functional.cross_entropy, nn.functional.nll_loss):
        weight, ignore = keywords.get("weight"), keywords.get("ignore_index", -100)
    else:
        return float(len(target))
    if target.is_floating_point():
        return float(len(target))
    return float(_class_denominator(output, target, weight, ignore))


def loss_sum_and_denominator(loss_fn: Callable[..., torch.Tensor], output: torch.Tensor,
                             target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
    """(sum of unreduced losses in float64, the denominator of ``loss_fn``'s own mean) for one batch."""
    losses, denominator = None, None
    if isinstance(loss_fn, nn.Module) and isinstance(getattr(loss_fn, "reduction", None), str):
        unreduced = copy.copy(loss_fn)  # shallow: shares weights, owns its reduction flag
        batchmean = loss_fn.reduction == "batchmean"
        unreduced.reduction = "none"
        losses = unreduced(output, target)
        if isinstance(loss_fn, _CLASS_LOSSES):
            denominator = _class_denominator(losses, target, loss_fn.weight, loss_fn.ignore_index)
        elif batchmean:
            denominator = float(len(target))
    elif not isinstance(loss_fn, nn.Module):
        try:
            losses = loss_fn(output, target, reduction="none")
        except TypeError:  # a custom function without a reduction argument
            losses = None
        fn, keywords = _function_of(loss_fn)
        if losses is not None and fn in (nn.functional.cross_entropy, nn.functional.nll_loss):
            denominator = _class_denominator(losses, target, keywords.get("weight"), keywords.get("ignore_index", -100))
    if losses is None or (denominator is None and (losses.dim() == 0 or losses.shape[0] != len(target))):
        n = len(target)  # a plain per-sample mean, as documented for other callables
        return loss_fn(output, target).detach().to(torch.float64) * n if n else torch.zeros((), dtype=torch.float64), \
            float(n)
    if denominator is None:
        denominator = float(losses.numel())
    return losses.detach().to(torch.float64).sum(), denominator


def reduce_all(metrics: Sequence[Metric], comm: Any = None, extra: torch.Tensor | None = None) -> torch.Tensor | None:
    """Sum every metric's sums (and ``extra``) across workers in ONE all-reduce.

    Returns the reduced ``extra`` (or None). ``comm`` defaults to a fresh
    :class:`phalanx.Comm`; in a group of one nothing is sent.
    """
    comm = comm or Comm()
    parts = [m.sums.to(torch.float64).cpu() for m in metrics]
    if extra is not None:
        parts.append(extra.to(torch.float64).cpu())
    if not parts:
        return None
    flat = torch.cat(parts)
    if comm.world_size > 1:
        flat = flat.to(group.device())  # NCCL wants device tensors; gloo takes either
        comm.all_reduce_([flat], op="sum")
        flat = flat.cpu()
    offset = 0
    for m in metrics:
        m.sums = flat[offset:offset + m.size].clone()
        offset += m.size
    return flat[offset:].clone() if extra is not None else None


def resolve(metric: Metric | str) -> Metric:
    """A metric object from an object or a name ("accuracy", "acc", "loss")."""
    if isinstance(metric, Metric):
        return metric
    if isinstance(metric, str):
        key = metric.strip().lower()
        if key in ("accuracy", "acc"):
            return Accuracy()
        if key in ("loss", "mean_loss"):
            return MeanLoss()
    raise ConfigError(usage(f"metric {metric!r}", "a phalanx.train.metrics.Metric or one of 'accuracy', 'loss'",
                            "Pass e.g. metrics=['accuracy'] or metrics=[Accuracy(top_k=5)]."))


class ThroughputMeter:
    """Samples per second over the steps after the first ``warmup_steps``.

    The first steps pay for allocator growth, thread-pool start and lazy
    initialisation, so they are timed but not counted. Call :meth:`start` when a
    stretch of training begins (each epoch: time between epochs, such as
    validation, is not counted) and :meth:`step` after every step.

    Example (a fake clock: two warm-up steps are slow, then 10 samples per second):
        >>> ticks = iter([0.0, 5.0, 9.0, 10.0, 11.0])
        >>> meter = ThroughputMeter(warmup_steps=2, clock=lambda: next(ticks))
        >>> meter.start()
        >>> for _ in range(4): meter.step(10)
        >>> meter.rate
        10.0
    """

    def __init__(self, warmup_steps: int = 5, clock: Callable[[], float] = time.perf_counter) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigError(usage(f"warmup_steps={warmup_steps!r}", "an integer >= 0",
                                    "Pass e.g. warmup_steps=5."))
        self.warmup_steps, self.clock = warmup_steps, clock
        self.steps = 0          # every step seen, warm-up included
        self.samples = 0        # samples in counted (post-warm-up) steps
        self.seconds = 0.0      # wall time of counted steps
        self._mark: float | None = None

    def start(self) -> None:
        """Begin (or resume) timing from now."""
        self._mark = self.clock()

    def step(self, samples: int) -> None:
        """Record one finished step of ``samples`` samples."""
        now = self.clock()
        if self._mark is None:
            self._mark = now  # never started: the first step cannot be timed
        self.steps += 1
        if self.steps > self.warmup_steps:
            self.samples += samples
            self.seconds += now - self._mark
        self._mark = now

    @property
    def rate(self) -> float:
        """This worker's samples/s after warm-up (nan before any counted step)."""
        return self.samples / self.seconds if self.seconds > 0 else math.nan

    def global_rate(self, comm: Any = None) -> float:
        """All workers' samples per second of wall time (call it on every worker).

        Synchronous workers share one wall clock, so the global rate is the sum of
        samples over the mean of the workers' counted seconds.
        """
        totals = reduce_all([], comm, extra=torch.tensor([float(self.samples), self.seconds]))
        samples, seconds = totals.tolist()
        seconds /= group.world_size()
        return samples / seconds if seconds > 0 else math.nan
