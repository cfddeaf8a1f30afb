"""px.wrap / px.unwrap: attach a strategy to the user's model and optimizer.

The optimizer that comes back is the user's own object: the strategy runs through
``register_step_pre_hook`` / ``register_step_post_hook``, public torch hooks, so
LR schedulers, ``state_dict`` and ``isinstance`` checks keep working.

Example:
    >>> import torch, phalanx as px
    >>> net = torch.nn.Linear(4, 2)
    >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    >>> px.unwrap(model) is net
    True
"""
from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import group
from .errors import ConfigError, usage
from .strategies import AllReduce, Strategy, by_name

_strategies: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Strategy]" = weakref.WeakKeyDictionary()


def wrap(model: nn.Module, optimizer: torch.optim.Optimizer,
         strategy: Strategy | str | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Make ``model`` and ``optimizer`` data-parallel under ``strategy`` (default ``px.AllReduce()``).

    Example:
        >>> import torch, phalanx as px
        >>> net = torch.nn.Linear(4, 2)
        >>> model, opt = px.wrap(net, torch.optim.Adam(net.parameters()), strategy="allreduce")
    """
    group._current()  # refuses a multi-worker run that skipped px.init()
    if not isinstance(model, nn.Module):
        raise ConfigError(usage(f"model of type {type(model).__name__}", "a torch.nn.Module",
                                "Pass your network object itself."))
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(usage(f"{type(model).__name__} with no trainable parameters",
                                "at least one parameter with requires_grad=True",
                                "Unfreeze some layers or check that the model was built."))
    if group.world_size() > 1 and group.device().type == "cpu" and \
            any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()):
        raise ConfigError(usage("nn.SyncBatchNorm on CPU workers", "GPU workers (torch's SyncBatchNorm needs them)",
                                "Keep plain BatchNorm: each worker then normalises with its own batch statistics."))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(usage(f"optimizer of type {type(optimizer).__name__}", "a torch.optim.Optimizer",
                                "Build it from the model's parameters, "
                                "e.g. torch.optim.SGD(model.parameters(), lr=0.1)."))
    if optimizer in _strategies:
        raise ConfigError(usage("an optimizer that px.wrap already wrapped", "a fresh optimizer",
                                "Call px.wrap once per model/optimizer pair."))
    strategy = _resolve(strategy)
    from .ps.config import warn_unused_servers  # here: phalanx.ps imports the checkpoint, which imports us
    warn_unused_servers(strategy, group.rank())  # `phalanx run --servers N` with a strategy that uses none
    model.to(group.device())
    module = strategy.attach(model, optimizer)
    optimizer.register_step_pre_hook(lambda *_: strategy.before_step())
    optimizer.register_step_post_hook(lambda *_: strategy.after_step())
    _strategies[optimizer] = strategy
    return module, optimizer


def _resolve(strategy: Strategy | str | None) -> Strategy:
    if strategy is None:
        return AllReduce()
    if isinstance(strategy, str):
        return by_name(strategy)
    if isinstance(strategy, type) and issubclass(strategy, Strategy):
        raise ConfigError(usage(f"the class {strategy.__name__}", "a strategy object",
                                f"Instantiate it: strategy=px.{strategy.__name__}()."))
    if not isinstance(strategy, Strategy):
        raise ConfigError(usage(f"strategy={strategy!r}", "a px.Strategy object or a strategy name",
                                "Use e.g. px.AllReduce() or px.LocalSGD(every=8)."))
    return strategy


def strategy_of(optimizer: torch.optim.Optimizer) -> Strategy | None:
    """The strategy ``px.wrap`` attached to ``optimizer``, if any."""
    return _strategies.get(optimizer)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's own module inside whatever ``px.wrap`` returned."""
    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model
