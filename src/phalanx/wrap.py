"""px.wrap / px.unwrap: attach a strategy to the user's model and optimizer.

The optimizer that comes back is the user's own object: the strategy runs through
public torch hooks (the end of backward, ``register_step_post_hook``, a forward
pre-hook; see :mod:`phalanx.step.clock`), so LR schedulers, ``state_dict`` and
``isinstance`` checks keep working.

Example:
    >>> import torch, phalanx as px
    >>> net = torch.nn.Linear(4, 2)
    >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    >>> px.unwrap(model) is net
    True
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .group import group
from .group.spans import TIMELINE
from .group.env import WorkerEnv
from .step import profiling, telemetry
from .step.compiled import original
from .errors import ConfigError, usage
from .sharding.layout import FullyShard
from .sharding.meta import on_meta
from .step.clock import StepClock
from .step.report import StepReport
from .strategies import AllReduce, Strategy, by_name
from .strategies.base import ServerBacked

# What px.wrap attached lives on the user's own objects, not in a module-level registry (the current group is the
# only module state): the optimizer knows its strategy, the model its step clock. Both already hold the clock
# through their hooks, so copying or pickling them is as it was.
_STRATEGY, _CLOCK = "_phalanx_strategy", "_phalanx_clock"


def tell_launch(strategy: Strategy, env: WorkerEnv) -> None:
    """Give a :class:`~phalanx.strategies.base.ServerBacked` rule the environment; for any other, warn (rank 0)
    when ``phalanx run --servers N`` started servers it leaves idle.

    Example:
        >>> tell_launch(AllReduce(), WorkerEnv())   # no servers started: nothing to say
    """
    if isinstance(strategy, ServerBacked):
        strategy.launched_with(env)
    elif env.ps_servers and env.rank == 0:
        warnings.warn(f"PHALANX_PS_ADDRS names {env.ps_servers} parameter servers (phalanx run --servers "
                      f"{env.ps_servers}) but strategy {type(strategy).__name__} uses none; drop --servers, or use "
                      "px.Downpour, px.AsyncEASGD or px.ParameterServer", stacklevel=4)


def wrap(model: nn.Module, optimizer: torch.optim.Optimizer,
         strategy: Strategy | str | None = None, *,
         shard: FullyShard | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Make ``model`` and ``optimizer`` data-parallel under ``strategy`` (default ``px.AllReduce()``).

    ``shard=px.FullyShard(group_size=S)`` shards the model, its gradients and the optimizer's
    state over groups of S workers (FSDP2), and ``strategy`` agrees across the groups
    (:mod:`phalanx.sharding.layout`); the model is then sharded in place and the optimizer points at
    its sharded parameters. A model built on the meta device (``with torch.device("meta"):``) needs
    ``shard=``: it is sharded first, then each worker allocates and initialises its own shards.

    Example:
        >>> import torch, phalanx as px
        >>> net = torch.nn.Linear(4, 2)
        >>> model, opt = px.wrap(net, torch.optim.Adam(net.parameters()), strategy="allreduce")
    """
    g = group.current()  # refuses a multi-worker run that skipped px.init()
    if not isinstance(model, nn.Module):
        raise ConfigError(usage(f"model of type {type(model).__name__}", "a torch.nn.Module",
                                "Pass your network object itself."))
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(usage(f"{type(model).__name__} with no trainable parameters",
                                "at least one parameter with requires_grad=True",
                                "Unfreeze some layers or check that the model was built."))
    if g.world_size > 1 and g.device.type == "cpu" and \
            any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()):
        raise ConfigError(usage("nn.SyncBatchNorm on CPU workers", "GPU workers (torch's SyncBatchNorm needs them)",
                                "Keep plain BatchNorm: each worker then normalises with its own batch statistics."))
    if not isinstance(optimizer, torch.optim.Optimizer):
        if _from_keras(optimizer):
            raise ConfigError(usage(f"a Keras optimizer ({type(optimizer).__name__}) passed to px.wrap",
                                    "a torch.optim.Optimizer (px.wrap is for PyTorch models)",
                                    "For a Keras model: model.compile(optimizer=...), then px.keras.wrap(model)."))
        raise ConfigError(usage(f"optimizer of type {type(optimizer).__name__}", "a torch.optim.Optimizer",
                                "Build it from the model's parameters, "
                                "e.g. torch.optim.SGD(model.parameters(), lr=0.1)."))
    if isinstance(model, DistributedDataParallel):
        raise ConfigError(usage(f"a DistributedDataParallel module around {type(model.module).__name__}",
                                "the plain module: px.wrap makes it data-parallel itself",
                                "Pass model.module (and an optimizer built from its parameters)."))
    if clock_of(unwrap(model)) is not None:
        raise ConfigError(usage(f"a {type(model).__name__} that px.wrap already wrapped",
                                "a model px.wrap has not taken yet",
                                "Call px.wrap once per model; keep the model and optimizer it returned."))
    if strategy_of(optimizer) is not None:
        raise ConfigError(usage("an optimizer that px.wrap already wrapped", "a fresh optimizer",
                                "Call px.wrap once per model/optimizer pair."))
    strategy = _resolve(strategy)
    if shard is not None and not isinstance(shard, FullyShard):
        raise ConfigError(usage(f"shard={shard!r}", "a px.FullyShard object or None",
                                "Pass e.g. shard=px.FullyShard(group_size=2)."))
    if shard is not None:
        shard.check(g, strategy)
    tell_launch(strategy, g.env)  # e.g. `phalanx run --servers N` with a strategy that uses none
    if g.env.profile_dir and TIMELINE.of(g).value is None:  # `phalanx run --profile DIR`: the first model starts it
        profiling.profile(g.env.profile_dir)
    if g.env.status:  # `phalanx run --status`: the workers report their steps to the page (phalanx.step.telemetry)
        telemetry.start(g)
    if on_meta(model):  # built on the meta device: FullyShard lays it out, then each worker fills its own shards
        if shard is None:
            raise ConfigError(usage(f"a {type(model).__name__} on the meta device without shard=",
                                    "shard=px.FullyShard(...), which shards it first and then initialises each "
                                    "worker's shards", "Pass shard=px.FullyShard(group_size=px.world_size()), or "
                                    "build the model on a real device."))
    else:
        model.to(g.device)
    if shard is not None:
        model = shard.apply(model, optimizer, strategy, g)
    module = strategy.attach(model, optimizer)
    strategy.clock.bind(strategy, model, module, optimizer)
    if shard is not None:
        shard.hook(model, strategy.clock)
    setattr(optimizer, _STRATEGY, strategy)
    if g.env.step_report:  # `phalanx run --link`: where the steps went, for its summary
        StepReport(g.env.step_report, strategy.clock, optimizer, rank=g.rank)
    # on the user's module, however compiled (px.no_sync finds it either way); not nn.Module's __setattr__: a clock
    # is no submodule
    object.__setattr__(unwrap(model), _CLOCK, strategy.clock)
    return module, optimizer


def _from_keras(obj: object) -> bool:
    """A Keras object, told by its classes' modules: importing Keras to ask would cost seconds."""
    return any((getattr(cls, "__module__", "") or "").startswith("keras.") for cls in type(obj).__mro__)


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
    return getattr(optimizer, _STRATEGY, None)


def clock_of(model: nn.Module) -> StepClock | None:
    """The step clock ``px.wrap`` gave ``model`` (the user's module), if any."""
    return getattr(model, "__dict__", {}).get(_CLOCK)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's own module inside whatever ``px.wrap`` returned, and inside ``torch.compile``'s wrapper.

    So ``px.save``, checkpoints and ``state_dict()`` keys are the plain module's, whichever
    order ``torch.compile`` and ``px.wrap`` were applied in.

    Example:
        >>> import torch, phalanx as px
        >>> net = torch.nn.Linear(2, 1)
        >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
        >>> px.unwrap(torch.compile(model)) is net
        True
    """
    while True:
        inner = original(model)
        if isinstance(inner, DistributedDataParallel):
            inner = inner.module
        if inner is model:
            return model
        model = inner


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients without exchanging them: every micro-batch but the last, as DDP's ``no_sync()``.

    A backward pass inside does not end a step; the next one outside it does, and
    averages the accumulated gradient. Works for every strategy (with ``px.AllReduce``
    it enters DDP's own ``no_sync``).

    Example:
        >>> import torch, phalanx as px
        >>> net = torch.nn.Linear(2, 1)
        >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
        >>> with px.no_sync(model):
        ...     model(torch.ones(1, 2)).sum().backward()      # micro-batch 1: accumulate only
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()   # micro-batch 2 ends the step
        >>> px.strategy_of(opt).steps
        1
    """
    clock = clock_of(unwrap(model))
    if clock is None:
        raise ConfigError(usage(f"px.no_sync on a {type(model).__name__} that px.wrap did not return",
                                "the model px.wrap returned", "Wrap it first: model, opt = px.wrap(model, opt)."))
    with clock.no_sync():
        yield
