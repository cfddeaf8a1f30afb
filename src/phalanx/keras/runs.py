"""Which Keras models ``px.keras.wrap`` took, and the run that drives each.

A leaf of ``phalanx.keras``: ``fit`` registers runs here and ``state`` looks them up,
so neither has to import the other.

Example:
    >>> import torch
    >>> from phalanx.keras.runs import run_of
    >>> run_of(torch.nn.Linear(1, 1)) is None     # never wrapped
    True
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .fit import KerasRun

_runs: "weakref.WeakKeyDictionary[Any, KerasRun]" = weakref.WeakKeyDictionary()


def run_of(model: Any) -> "KerasRun | None":
    """The run ``px.keras.wrap`` attached to ``model``, if any."""
    return _runs.get(model)
