"""The weight of this worker's current batch in the global mean gradient.

Gradient averaging takes the plain mean of the workers' mean-loss gradients. That
equals one process on the combined batch only when every worker holds the same
number of samples. On an uneven step (the short last global batch) the loader sets
``n_i * world_size / total`` here for the batch it just yielded, and the gradient
exchange scales this worker's gradient by it before averaging, so the result is
the gradient of one process on the same samples.

Example:
    >>> from phalanx.batchweight import batch_weight, set_batch_weight
    >>> set_batch_weight(0.5); batch_weight()
    0.5
    >>> set_batch_weight(1.0)
"""
from __future__ import annotations

_weight = 1.0


def set_batch_weight(weight: float) -> None:
    """Called by the loader after yielding a batch (1.0 when every worker holds the same count)."""
    global _weight
    _weight = float(weight)


def batch_weight() -> float:
    """This worker's weight for the current step's gradient (1.0 on every even step)."""
    return _weight
