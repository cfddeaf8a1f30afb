"""Learning-rate rules for large global batches (Goyal et al. 2017).

Example:
    >>> import phalanx as px
    >>> px.scale_lr(0.1, base_batch=256, batch=512)
    0.2
"""
from __future__ import annotations

import torch

from .. import check


def scale_lr(lr: float, *, base_batch: int, batch: int) -> float:
    """Linear scaling rule: ``lr * batch / base_batch``.

    Example:
        >>> scale_lr(0.1, base_batch=256, batch=64)
        0.025
    """
    hint = "Pass the learning rate for base_batch, and the global batch as batch=."
    check.positive_float("scale_lr(lr", lr, hint, close=")")
    check.positive_int("scale_lr(base_batch", base_batch, hint, close=")")
    check.positive_int("scale_lr(batch", batch, hint, close=")")
    return lr * batch / base_batch


def warmup(optimizer: torch.optim.Optimizer, steps: int, *, base_batch: int | None = None, batch: int | None = None,
           start_factor: float | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """Gradual warm-up (Goyal et al. 2017, section 2.2): a linear ramp up to the optimizer's lr over ``steps`` steps.

    The optimizer's lr is the target, the scaled lr ``k * lr_base`` of :func:`scale_lr`.
    Goyal et al. start the ramp at ``lr_base``, the lr of the *base* batch, and add a
    constant amount each step until the target is reached after ``steps`` steps (their 5
    epochs): pass ``base_batch`` and ``batch`` as to :func:`scale_lr` for that, i.e. a
    start factor of ``base_batch / batch``. Without them the first step uses
    ``lr / steps`` (the first nonzero value of a ramp from 0), so no step is wasted at
    lr 0; ``start_factor`` sets the first step's fraction of the lr directly.
    Call ``scheduler.step()`` once per optimizer step.

    Example (target lr 0.4 for a global batch of 1024; the base batch of 256 used lr 0.1):
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)
        >>> sched = warmup(opt, steps=4, base_batch=256, batch=1024)
        >>> lrs = []
        >>> for _ in range(5):
        ...     lrs.append(round(opt.param_groups[0]["lr"], 3)); opt.step(); sched.step()
        >>> lrs
        [0.1, 0.2, 0.3, 0.4, 0.4]
        >>> sched = warmup(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), steps=4)
        >>> [round(sched.lr_lambdas[0](s), 2) for s in range(5)]
        [0.25, 0.5, 0.75, 1.0, 1.0]
    """
    steps = check.positive_int("warmup(steps", steps, "Pass e.g. 5 epochs' worth of optimizer steps.", close=")")
    if (base_batch is None) != (batch is None) or (base_batch is not None and start_factor is not None):
        raise check.ConfigError(check.usage(
            f"warmup(base_batch={base_batch!r}, batch={batch!r}, start_factor={start_factor!r})",
            "both base_batch and batch, or start_factor, or neither",
            "Pass the batches as to px.scale_lr to start at the base batch's lr."))
    if base_batch is not None:
        hint = "Pass the batches as to px.scale_lr."
        start = check.positive_int("warmup(base_batch", base_batch, hint, close=")") / \
            check.positive_int("warmup(batch", batch, hint, close=")")
        start = min(1.0, start)
    elif start_factor is not None:
        start = check.fraction("warmup(start_factor", start_factor, "Pass the first step's fraction of the lr, "
                               "e.g. 0.1.", close=")")
    else:
        start = 1.0 / steps
    span = max(1, steps - 1)  # step 0 uses start * lr, step steps - 1 the full lr

    def factor(step: int) -> float:
        return start + (1.0 - start) * min(1.0, step / span)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
