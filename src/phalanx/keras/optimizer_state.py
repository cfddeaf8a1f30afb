"""The Keras optimizer's state as a torch-style ``state_dict``, and a resumable checkpoint for Keras runs.

:class:`OptimizerState` gives a Keras optimizer the two methods phalanx's state code
calls on a torch optimizer (``state_dict``/``load_state_dict``): its variables
(iteration count, learning rate, moments...) as CPU tensors. Strategies keep it as
their ``optimizer`` (LocalSGD saves each replica's moments through it).

:func:`save_checkpoint` / :func:`load_checkpoint` write and restore what an exact
resume needs at an epoch boundary: weights, optimizer variables, the strategy's
shared state and each worker's own part, every worker's torch RNG, and the epoch.
The file is phalanx's verified format (SHA-256, loaded with ``weights_only=True``).

Example:
    >>> from phalanx.keras.keras_api import keras
    >>> opt = keras.optimizers.SGD(0.1, momentum=0.9); opt.build([keras.Variable([1.0, 2.0])])
    >>> sorted(OptimizerState(opt).state_dict())
    ['paths', 'variables']
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from ..group import group
from ..checkpoint import read_checkpoint, write_verified
from ..checkpoint.training_state import load_replica_state, replica_state
from ..group.collectives import Comm
from ..errors import CheckpointError
from ..strategies.base import load_state_with_step, state_with_step
from .runs import run_of


class OptimizerState:
    """A Keras optimizer's variables behind ``state_dict()`` / ``load_state_dict()``.

    It also offers torch's ``register_step_pre_hook`` and ``register_step_post_hook``, through
    which phalanx's step clock learns that a step begins and was applied; ``px.keras.wrap`` calls
    :meth:`stepping` before and :meth:`stepped` after every ``optimizer.apply``.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.strategy: Any = None  # set by px.keras.wrap
        self._pre_hooks: dict[int, Callable[..., Any]] = {}
        self._post_hooks: dict[int, Callable[..., Any]] = {}

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> "_Handle":
        """As ``torch.optim.Optimizer.register_step_pre_hook``: ``hook(self, args, kwargs)`` before each step."""
        key = max(self._pre_hooks, default=-1) + 1
        self._pre_hooks[key] = hook
        return _Handle(self._pre_hooks, key)

    def stepping(self) -> None:
        """Run the pre-step hooks (Keras's optimizer is about to apply one step)."""
        for hook in list(self._pre_hooks.values()):
            hook(self, (), {})

    def register_step_post_hook(self, hook: Callable[..., Any]) -> "_Handle":
        """As ``torch.optim.Optimizer.register_step_post_hook``: ``hook(self, args, kwargs)`` after each step."""
        key = max(self._post_hooks, default=-1) + 1
        self._post_hooks[key] = hook
        return _Handle(self._post_hooks, key)

    def stepped(self) -> None:
        """Run the post-step hooks (Keras's optimizer has applied one step)."""
        for hook in list(self._post_hooks.values()):
            hook(self, (), {})

    def state_dict(self) -> dict[str, Any]:
        variables = self.optimizer.variables
        return {"paths": [v.path for v in variables], "variables": [v.value.detach().cpu().clone() for v in variables]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        variables = self.optimizer.variables
        if len(variables) != len(state["variables"]):
            raise CheckpointError(f"the saved optimizer state has {len(state['variables'])} variables but this "
                                  f"optimizer has {len(variables)}; expected the same optimizer and model. "
                                  "Compile the model as in the saved run, then load.")
        for v, saved in zip(variables, state["variables"], strict=True):
            v.assign(saved.to(v.value.device))


class _Handle:
    def __init__(self, hooks: dict[int, Any], key: int) -> None:
        self.hooks, self.key = hooks, key

    def remove(self) -> None:
        self.hooks.pop(self.key, None)


def model_state_dict(model: Any) -> list[torch.Tensor]:
    """Every variable of ``model`` (trainable, statistics, seed state) in Keras's order, as CPU tensors."""
    return [v.value.detach().cpu().clone() for v in model.variables]


def load_model_state_dict(model: Any, saved: list[torch.Tensor]) -> None:
    variables = model.variables
    if len(variables) != len(saved) or any(tuple(v.shape) != tuple(s.shape) for v, s in zip(variables, saved)):
        raise CheckpointError("the checkpoint holds weights for another model; expected the same architecture. "
                              "Build the model as in the saved run, then load.")
    for v, s in zip(variables, saved, strict=True):
        v.assign(s.to(v.value.device))


def save_checkpoint(path: str | os.PathLike, model: Any, *, epoch: int) -> None:
    """Collective (call on every worker): write the state to resume ``model`` at ``epoch`` (main worker writes)."""
    run = run_of(model)
    comm = run.comm if run is not None else Comm()
    strategy = run.strategy if run is not None else None
    if strategy is not None:
        strategy.clock.settle()  # a skipped step is closed on every worker before the state is read
    rngs = comm.all_gather(torch.get_rng_state())
    replicas = comm.all_gather_state(replica_state(strategy)) if strategy is not None else None
    if not group.is_main():
        return
    write_verified(path, {
        "keras_model": model_state_dict(model),
        "keras_optimizer": OptimizerState(model.optimizer).state_dict(),
        "strategy": state_with_step(strategy) if strategy is not None else None,
        "replicas": replicas,
        "torch_rng_per_rank": rngs,
        "epoch": int(epoch),
        "world_size": group.world_size(),
    })


def load_checkpoint(path: str | os.PathLike, model: Any) -> int:
    """Restore what :func:`save_checkpoint` wrote into ``model``; returns the epoch to pass as ``initial_epoch``."""
    body = read_checkpoint(path)
    if "keras_model" not in body:
        raise CheckpointError(f"{os.fspath(path)!r} is not a Keras checkpoint; expected a file from "
                              "px.keras.save_checkpoint (px.save_checkpoint files load with px.load_checkpoint).")
    load_model_state_dict(model, body["keras_model"])
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    OptimizerState(model.optimizer).load_state_dict(body["keras_optimizer"])
    run = run_of(model)
    if run is not None and body["strategy"] is not None:
        load_state_with_step(run.strategy, body["strategy"])
        replicas = body["replicas"] or []
        if len(replicas) == group.world_size():
            load_replica_state(run.strategy, replicas[group.rank()])
    per_rank = body["torch_rng_per_rank"]
    if group.rank() < len(per_rank):
        torch.set_rng_state(per_rank[group.rank()])
    return int(body["epoch"])
