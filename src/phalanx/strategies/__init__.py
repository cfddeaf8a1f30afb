"""Strategies: one small class per rule for how replicas agree."""
from __future__ import annotations

from typing import Callable

from ..errors import ConfigError, usage
from .allreduce import AllReduce
from .base import Exchange, ParameterAverage, Periodic, Strategy, SyncCondition

# name -> factory with the literature's defaults; the benchmark and CLI use these names.
REGISTRY: dict[str, Callable[[], Strategy]] = {
    "allreduce": AllReduce,
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


__all__ = ["AllReduce", "Exchange", "ParameterAverage", "Periodic", "Strategy", "SyncCondition",
           "REGISTRY", "by_name", "register"]
