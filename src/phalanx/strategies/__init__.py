"""Strategies: one small class per rule for how replicas agree."""
from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import Callable, Iterator, Mapping

from .compression import FP16, PowerSGD, Threshold, TopK
from ..errors import ConfigError, usage
from .accounting import Accounted, Accounting
from .allreduce import AllReduce
from .auto import Auto
from .base import Exchange, ParameterAverage, Periodic, Strategy, SyncCondition
from .diloco import DiLoCo, OuterStep
from .easgd import EASGD, Elastic
from .gradients import average_gradients_, fill_missing_grads
from .local_sgd import LocalSGD
from .streaming_diloco import StreamingDiLoCo

# name -> factory with the literature's defaults; built once, read-only. The benchmark and CLI use these names.
PRESETS: Mapping[str, Callable[[], Strategy]] = MappingProxyType({
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
})


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _named_classes() -> dict[str, type[Strategy]]:
    """Every ``Strategy`` subclass that declares a ``name`` of its own (not inherited), by that name.

    Found by class, so nothing is registered anywhere: ``phalanx.ps``'s rules and a user's rule
    are known once their class exists. Of two classes with one name, the one found last (a subclass
    over its base) wins.
    """
    found: dict[str, type[Strategy]] = {}
    todo = list(Strategy.__subclasses__())
    while todo:
        cls = todo.pop(0)
        todo.extend(cls.__subclasses__())
        own = cls.__dict__.get("name")
        if isinstance(own, str):
            found[_key(own)] = cls
    return found


class _Names(Mapping[str, Callable[[], Strategy]]):
    """The strategy names ``px.wrap(..., strategy="name")`` and ``phalanx bench`` know: :data:`PRESETS`, then every
    ``Strategy`` subclass with a ``name`` of its own. A read-only view: it holds nothing.

    Example:
        >>> "diloco" in REGISTRY and "downpour" in REGISTRY
        True
    """

    def __getitem__(self, name: str) -> Callable[[], Strategy]:
        key = _key(name)
        if key in PRESETS:
            return PRESETS[key]
        return _named_classes()[key]

    def __iter__(self) -> Iterator[str]:
        return iter({**dict.fromkeys(PRESETS), **dict.fromkeys(_named_classes())})

    def __len__(self) -> int:
        return len(set(PRESETS) | set(_named_classes()))


#: Every known strategy name -> its factory (read-only; see :class:`_Names`).
REGISTRY: Mapping[str, Callable[[], Strategy]] = _Names()


def register(name: str, factory: Callable[[], Strategy]) -> None:
    """Deprecated: declare ``name = "..."`` on the strategy class instead; ``by_name`` finds it by class.

    Kept for one release: for a class, sets its ``name`` (with a DeprecationWarning).
    """
    if not (isinstance(factory, type) and issubclass(factory, Strategy)):
        raise ConfigError(usage(f"strategies.register({name!r}, {factory!r})", "a px.Strategy subclass",
                                "Declare name = \"...\" on your Strategy subclass; px.wrap(strategy=\"...\") then "
                                "finds it, no registration needed."))
    warnings.warn(f"phalanx.strategies.register is deprecated: declare name = {name!r} on {factory.__name__} "
                  "instead (px.wrap finds the class by that name)", DeprecationWarning, stacklevel=2)
    factory.name = name  # type: ignore[attr-defined]  # the class is the registry: by_name reads its own name


def by_name(name: str) -> Strategy:
    """Build the named strategy with its default settings.

    Example:
        >>> by_name("local_sgd")
        LocalSGD(every(8))
    """
    if name not in REGISTRY:
        raise ConfigError(usage(f"unknown strategy {name!r}", "one of " + ", ".join(sorted(REGISTRY)),
                                "Pass a strategy object such as px.AllReduce(), or one of those names."))
    return REGISTRY[name]()


__all__ = ["average_gradients_", "fill_missing_grads", "Accounted", "Accounting",
           "AllReduce", "Auto", "DiLoCo", "EASGD", "Elastic", "Exchange", "LocalSGD", "OuterStep", "ParameterAverage",
           "Periodic", "PRESETS", "StreamingDiLoCo", "Strategy", "SyncCondition", "REGISTRY", "by_name", "register"]
