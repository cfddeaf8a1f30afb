"""Learning-rate rules for large global batches (Goyal et al. 2017).

Example:
    >>> import phalanx as px
    >>> px.scale_lr(0.1, base_batch=256, batch=512)
    0.2
"""
from __future__ import annotations

import torch

from .errors import ConfigError, usage


def scale_lr(lr: float, *, base_batch: int, batch: int) -> float:
    """Linear scaling rule: ``lr * batch / base_batch``.

    Example:
        >>> scale_lr(0.1, base_batch=256, batch=64)
        0.025
    """
    if lr <= 0 or base_batch < 1 or batch < 1:
        raise ConfigError(usage(f"scale_lr(lr={lr}, base_batch={base_batch}, batch={batch})",
                                "lr > 0 and batch sizes >= 1", "Pass the global batch as batch=."))
    return lr * batch / base_batch


def warmup(optimizer: torch.optim.Optimizer, steps: int,
           start_factor: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """Gradual warm-up: ramp the LR linearly from ``start_factor * lr`` to ``lr`` over ``steps``.

    Goyal et al. ramp over 5 epochs; call ``scheduler.step()`` once per optimizer step.

    Example:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> sched = warmup(opt, steps=4)
        >>> lrs = []
        >>> for _ in range(5):
        ...     opt.step(); sched.step(); lrs.append(round(opt.param_groups[0]["lr"], 2))
        >>> lrs
        [0.25, 0.5, 0.75, 1.0, 1.0]
    """
    if steps < 1:
        raise ConfigError(usage(f"warmup steps={steps}", "an integer >= 1", "Pass e.g. 5 epochs' worth of steps."))
    if not 0.0 <= start_factor <= 1.0:
        raise ConfigError(usage(f"start_factor={start_factor}", "a value in [0, 1]", "Use 0.0 or e.g. 0.1."))

    def factor(step: int) -> float:
        return start_factor + (1.0 - start_factor) * min(1.0, step / steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
