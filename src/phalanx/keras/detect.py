"""Recognise Keras and TensorFlow objects without importing either.

``phalanx.wrap`` (the plain-PyTorch API) uses :func:`is_keras_optimizer` to refuse a
Keras optimizer with a pointer to ``px.keras.wrap``; importing Keras just to ask would
cost seconds, so these checks read class names and modules only.

Example:
    >>> import torch
    >>> is_keras_optimizer(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))
    False
"""
from __future__ import annotations

from typing import Any


def _modules(obj: Any) -> list[str]:
    return [getattr(cls, "__module__", "") or "" for cls in type(obj).__mro__]


def is_keras_optimizer(obj: Any) -> bool:
    """True for a Keras 3 optimizer (any backend), without importing Keras."""
    return any(m.startswith("keras.") and cls.__name__ in ("Optimizer", "BaseOptimizer")
               for m, cls in zip(_modules(obj), type(obj).__mro__))


def is_keras_model(obj: Any) -> bool:
    """True for a ``keras.Model`` (Sequential, functional or subclassed)."""
    return any(m.startswith("keras.") and cls.__name__ == "Model"
               for m, cls in zip(_modules(obj), type(obj).__mro__))


def is_tf_dataset(obj: Any) -> bool:
    """True for a ``tf.data.Dataset`` (or its iterator), which phalanx cannot shard."""
    return any(m.startswith("tensorflow.") and ("Dataset" in cls.__name__ or "Iterator" in cls.__name__)
               for m, cls in zip(_modules(obj), type(obj).__mro__))


def ddp_inside(model: Any) -> str | None:
    """Where a ``DistributedDataParallel`` already wraps ``model``'s weights, if anywhere.

    Keras 3.15's torch trainer has no DDP; a future one might wrap the model itself
    (as an attribute of the model or its trainer). Averaging there and again in phalanx
    would halve every gradient step's effective learning rate, so ``wrap`` refuses.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "the model itself"
    for name, value in list(vars(model).items()):
        if isinstance(value, DistributedDataParallel):
            return f"model.{name}"
    modules = getattr(model, "modules", None)
    if callable(modules):
        for sub in modules():
            if isinstance(sub, DistributedDataParallel):
                return f"a sub-module of type {type(sub).__name__}"
    return None
