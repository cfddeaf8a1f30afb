"""Exact Keras metrics across workers: add up the metrics' state, then compute the result.

A Keras metric keeps running state in variables (``Mean``: total and count;
``Precision``: true and false positive counts...). For those whose state is a sum
over samples, adding every worker's state gives the state one process would hold
after seeing every worker's samples, so the result is exact: the loss, accuracy and
any mean-based metric equal one process's on the whole data. Metrics whose state is
not a sum are reported from this worker's own samples, with a warning.

Example:
    >>> from phalanx.keras.keras_api import keras
    >>> additive(keras.metrics.SparseCategoricalAccuracy()), additive(keras.metrics.Metric())
    (True, False)
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from ..group.collectives import Comm
from .keras_api import keras

# Built-in metrics whose every state variable is a sum over samples (so adds across workers).
_ADDITIVE_NAMES = ("Mean", "Sum", "Precision", "Recall", "AUC", "TruePositives", "TrueNegatives", "FalsePositives",
                   "FalseNegatives", "PrecisionAtRecall", "RecallAtPrecision", "SensitivityAtSpecificity",
                   "SpecificityAtSensitivity", "IoU", "MeanIoU", "BinaryIoU", "OneHotIoU", "OneHotMeanIoU",
                   "R2Score", "F1Score", "FBetaScore")
_ADDITIVE = tuple(c for c in (getattr(keras.metrics, n, None) for n in _ADDITIVE_NAMES) if isinstance(c, type))


def additive(metric: Any) -> bool:
    """True when ``metric``'s state is a sum over samples (``Mean`` and its many subclasses, counts...)."""
    return isinstance(metric, _ADDITIVE)


def leaves(metrics: list[Any]) -> list[Any]:
    """The metrics themselves, looking inside containers (``compile_metrics``) that hold others."""
    out = []
    for m in metrics:
        inner = getattr(m, "metrics", None)
        if isinstance(inner, list) and not additive(m):
            out.extend(leaves(inner))
        else:
            out.append(m)
    return out


class ExactMetrics:
    """Computes a model's metrics from every worker's summed state (one all-reduce per call)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._warned: set[str] = set()

    def results(self, model: Any, compute: Any) -> dict[str, Any]:
        """``compute()`` (the model's own ``get_metrics_result``) evaluated on the summed state."""
        if self.comm.world_size == 1:
            return compute()
        exact = [m for m in leaves(list(model.metrics)) if additive(m)]
        self._warn([m for m in leaves(list(model.metrics)) if not additive(m)])
        variables = [v for m in exact for v in m.variables]
        if not variables:
            return compute()
        local = [v.value.detach().clone() for v in variables]
        flat = torch.cat([t.reshape(-1).to(torch.float64).cpu() for t in local])
        self.comm.all_reduce_([flat], op="sum")
        offset = 0
        for v, t in zip(variables, local, strict=True):
            n = t.numel()
            v.assign(flat[offset:offset + n].reshape(t.shape).to(t.dtype))
            offset += n
        try:
            return compute()
        finally:  # the running state stays this worker's own, so later steps do not count twice
            for v, t in zip(variables, local, strict=True):
                v.assign(t)

    def _warn(self, metrics: list[Any]) -> None:
        for m in metrics:
            if m.name not in self._warned:
                self._warned.add(m.name)
                warnings.warn(f"phalanx: the metric {m.name!r} ({type(m).__name__}) keeps state that is not a sum "
                              "over samples, so it cannot be combined exactly across workers; the value reported "
                              "is each worker's own, over its shard only. Subclass keras.metrics.Mean or Sum to "
                              "make it exact.", UserWarning, stacklevel=3)
