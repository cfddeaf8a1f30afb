"""Strategies: one small class per rule for how replicas agree."""
from __future__ import annotations

from typing import Callable

from .compression import FP16, PowerSGD, Threshold, TopK
from ..errors import ConfigError, usage
from .allreduce import AllReduce
from .base import Exchange, ParameterAverage, Periodic, Strategy, SyncCondition
from .diloco import DiLoCo, OuterStep
from .easgd import EASGD, Elastic
from .gradients import average_gradients_, fill_missing_grads
from .local_sgd import LocalSGD
from .streaming_diloco import StreamingDiLoCo

# name -> factory with the literature's defaults; the benchmark and CLI use these names.
REGISTRY: dict[str, Callable[[], Strategy]] = {
    "allreduce": AllReduce,
    "local-sgd": LocalSGD,                                              # every=8
    "post-local-sgd": lambda: LocalSGD(every=16, warmup_steps=500),      # Lin et al. 2020
    "diloco": DiLoCo,                                                   # every=50, Nesterov 0.7 / 0.9
    "easgd": EASGD,                                                     # every=4, beta = 0.9
    "streaming-diloco": StreamingDiLoCo,                                # H=100, P=4, tau=1 (Douillard 2025)
    "fp16": lambda: AllReduce(compression=FP16()),
    "topk": lambda: AllReduce(compression=TopK(0.01)),
    "threshold": lambda: AllReduce(compression=Threshold(1e-3)),
    "powersgd": lambda: AllReduce(compression=PowerSGD(rank=4)),
}


def register(name: str, factory: Callable[[], Strategy]) -> None:
    """Make a strategy available by name to ``px.wrap`` and ``phalanx bench``."""
    REGISTRY[name] = factory


def by_name(name: str) -> Strategy:
    """Build the named strategy with its default settings."""
    key = name.strip().lower().replace("_", "-")
    if key not in REGISTRY:
        raise ConfigError(usage(f"unknown strategy {name!r}", "one of " + ", ".join(sorted(REGISTRY)),
                                "Pass a strategy object such as px.AllReduce(), or one of those names."))
    return REGISTRY[key]()


__all__ = ["average_gradients_", "fill_missing_grads",
           "AllReduce", "DiLoCo", "EASGD", "Elastic", "Exchange", "LocalSGD", "OuterStep", "ParameterAverage",
           "Periodic", "StreamingDiLoCo", "Strategy", "SyncCondition", "REGISTRY", "by_name", "register"]
