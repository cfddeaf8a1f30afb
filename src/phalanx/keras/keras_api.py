"""The one place phalanx imports Keras, checks its backend, and states what it relies on.

phalanx drives Keras 3 through public names only: ``Model.fit``/``evaluate``/
``get_metrics_result``/``compute_metrics``, ``Optimizer.apply``, callbacks and
``PyDataset``. It also relies on how Keras 3.15's torch trainer calls them: one
``optimizer.apply(grads, variables)`` per ``train_step`` after ``loss.backward()``;
``fit`` runs validation through ``self.evaluate``; ``compute_metrics`` reads
``get_metrics_result`` every step. ``tests/keras/test_keras.py::test_keras_calls_what_phalanx_relies_on``
checks exactly these, so a Keras upgrade that changes them fails loudly.

Example:
    >>> from phalanx.keras.keras_api import TESTED_KERAS
    >>> TESTED_KERAS
    '3.15.1'
"""
from __future__ import annotations

import os

from ..errors import ConfigError, usage

TESTED_KERAS = "3.15.1"

# Keras reads its backend once, at its first import; torch is the only one phalanx can drive.
os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402 - after the backend default; missing? pip install 'phalanx[keras]'


def check_backend() -> None:
    """Refuse a Keras that runs on another backend (JAX, TensorFlow)."""
    backend = keras.backend.backend()
    if backend != "torch":
        raise ConfigError(usage(f"Keras on the {backend!r} backend", "the 'torch' backend",
                                "Set KERAS_BACKEND=torch before anything imports keras "
                                "(or in ~/.keras/keras.json), then restart Python."))


__all__ = ["keras", "check_backend", "TESTED_KERAS"]
