"""TrainingState: everything one worker needs to continue a run exactly, as one snapshot.

``capture()`` takes this worker's snapshot (detached CPU copies, no collective);
``restore(snapshot)`` applies one. A checkpoint is every worker's snapshot in one
file (:func:`phalanx.save_checkpoint`); an in-memory commit is a snapshot kept in
a variable. A snapshot holds:

* ``model``: the user's module's ``state_dict`` (this worker's replica: local
  strategies and BatchNorm statistics differ per worker);
* ``optimizer``: the optimizer's ``state_dict`` (momentum, Adam moments...);
* ``strategy``: the strategy's shared state (``state_dict()``, the same on every
  worker: step count, anchor, centre, outer momentum...);
* ``replica``: the strategy's own state for this worker
  (``replica_state_dict()``: compressor residuals, a drifting replica...);
* ``loader``: the data position, world-size independent (epoch, seed, samples
  trained on), re-split over the current workers on restore;
* ``rng``: this worker's Python, NumPy, torch and CUDA generators;
* ``scheduler`` and ``scaler``: an LR scheduler's and a GradScaler's state, when given;
* ``step`` and ``extra`` (the caller's own plain values).

Example:
    >>> import torch, phalanx as px
    >>> from phalanx.checkpoint.training_state import TrainingState
    >>> net = torch.nn.Linear(2, 1); opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> state = TrainingState(net, opt, step=5)
    >>> snapshot = state.capture()
    >>> with torch.no_grad(): _ = net.weight.zero_()
    >>> state.restore(snapshot); bool(net.weight.abs().sum() > 0), state.step
    (True, 5)
"""
from __future__ import annotations

import copy
import random
import warnings
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from ..errors import CheckpointError
from ..group import group
from ..group.collectives import gather_object
from ..strategies.base import device_of, load_state_with_step, state_with_step
from ..wrap import strategy_of, unwrap

FORMAT = "phalanx-state-1"


@runtime_checkable
class ReplicaState(Protocol):
    """A rule whose workers each hold state the others do not share (compressor residuals, a drifting replica).

    A snapshot keeps it per worker (:data:`PER_WORKER`); a rule without it has none.
    """

    def replica_state_dict(self) -> dict[str, Any]: ...

    def load_replica_state_dict(self, state: dict[str, Any]) -> None: ...


def replica_state(strategy: Any) -> dict[str, Any]:
    """``strategy``'s own state on this worker (:class:`ReplicaState`); {} where it keeps none. A pure read.

    Example:
        >>> import phalanx as px
        >>> replica_state(px.Strategy()), replica_state(px.AllReduce())
        ({}, {})
    """
    return strategy.replica_state_dict() if isinstance(strategy, ReplicaState) else {}


def load_replica_state(strategy: Any, state: dict[str, Any]) -> None:
    """Put back what :func:`replica_state` returned on this worker (nothing where the rule keeps none)."""
    if isinstance(strategy, ReplicaState):
        strategy.load_replica_state_dict(state)
#: The parts of a snapshot that belong to one worker only; the rest is shared by all.
PER_WORKER = ("replica", "rng")


class TrainingState:
    """The per-worker state of a run: model, optimizer, strategy, data position, RNG, step.

    Args:
        model: the module ``px.wrap`` returned (or the user's own).
        optimizer: the optimizer; its strategy (``px.strategy_of``) is captured with it.
        loader: a ``px.shard`` loader (anything with ``state_dict``/``load_state_dict``).
        scheduler, scaler: an LR scheduler and a ``torch.amp.GradScaler``, when used.
        extra: the caller's own plain values (numbers, strings, tensors, lists, dicts).
        step: the caller's step count, kept and restored as ``state.step``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, loader: Any = None,
                 scheduler: Any = None, scaler: Any = None, extra: dict[str, Any] | None = None,
                 step: int = 0) -> None:
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.scheduler, self.scaler = scheduler, scaler
        self.extra = dict(extra or {})
        self.step = int(step)

    @property
    def strategy(self) -> Any:
        if self.optimizer is None:
            return None
        # A Keras run passes px.keras.optimizer_of(model), which carries its strategy itself.
        return strategy_of(self.optimizer) or getattr(self.optimizer, "strategy", None)

    def settle(self) -> None:
        """Close a step this worker skipped, so the snapshot counts it (collective: call on every worker)."""
        if self.strategy is not None:
            self.strategy.clock.settle()

    def capture(self) -> dict[str, Any]:
        """This worker's snapshot: detached CPU copies of tensors and plain values; no collective.

        A step this worker skipped and has not closed yet is not in it: call :meth:`settle` first.
        """
        strategy = self.strategy
        replica = replica_state(strategy) if strategy is not None else None
        return {
            "format": FORMAT, "rank": group.rank(), "world_size": group.world_size(), "step": self.step,
            "model": cpu_copy(unwrap(self.model).state_dict()),
            "optimizer": cpu_copy(self.optimizer.state_dict()) if self.optimizer is not None else None,
            "strategy": cpu_copy(state_with_step(strategy)) if strategy is not None else None,
            "replica": cpu_copy(replica) if replica else None,
            "loader": copy.deepcopy(self.loader.state_dict()) if self.loader is not None else None,
            "scheduler": cpu_copy(self.scheduler.state_dict()) if self.scheduler is not None else None,
            "scaler": cpu_copy(self.scaler.state_dict()) if self.scaler is not None else None,
            "rng": rng_state(),
            "extra": cpu_copy(self.extra),
        }

    def restore(self, snapshot: dict[str, Any], *, joining: bool = False) -> None:
        """Apply ``snapshot`` to this worker; parts it lacks (see :func:`shared`) are left as they are.

        The order matters: the optimizer after the model (it maps its state onto the
        parameters' devices), the strategy's replica state after its shared state, the
        RNG last (loading anything must not shift the streams). ``joining``: this worker enters
        a running elastic job (see :class:`phalanx.strategies.base.Joinable`).
        """
        if snapshot.get("model") is not None:  # None: a checkpoint directory restored the model already
            unwrap(self.model).load_state_dict(snapshot["model"])
        if self.optimizer is not None and snapshot.get("optimizer") is not None:
            self.optimizer.load_state_dict(snapshot["optimizer"])
        strategy = self.strategy
        if strategy is not None:
            device = device_of(self.model)
            if device.type == "meta":  # a sharded model let go of its layout at a regroup (sharding.reshard.let_go)
                device = group.device()  # until the reshard gives it its rows again, on this worker's device
            if snapshot.get("strategy") is not None:
                load_state_with_step(strategy, to_device(snapshot["strategy"], device), joining=joining)
            if snapshot.get("replica"):
                load_replica_state(strategy, to_device(snapshot["replica"], device))
        if self.loader is not None and snapshot.get("loader") is not None:
            self.loader.load_state_dict(snapshot["loader"])
        if self.scheduler is not None and snapshot.get("scheduler") is not None:
            self.scheduler.load_state_dict(snapshot["scheduler"])
        if self.scaler is not None and snapshot.get("scaler") is not None:
            self.scaler.load_state_dict(snapshot["scaler"])
        self.step = int(snapshot.get("step", self.step))
        self.extra = dict(snapshot.get("extra") or {})
        if snapshot.get("rng") is not None:
            set_rng_state(snapshot["rng"])


def shared(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The part of a snapshot every worker may take: without the strategy's replica state and the RNG.

    This is what a worker restores when the world size changed: rank 0's model,
    optimizer, strategy state and data position; its own generators stay as they are.
    """
    return {k: v for k, v in snapshot.items() if k not in PER_WORKER}


def resize_warning(saved: int, now: int, what: str) -> None:
    """Say once, clearly, what a resume under another world size cannot continue exactly."""
    warnings.warn(f"{what} was taken with {saved} workers and this run has {now}: every worker resumes from "
                  "rank 0's model, optimizer, strategy state and data position (the rest of the epoch is "
                  "re-split over the new workers), but not from per-worker state (compressor residuals, "
                  "drifting replicas, RNG streams), so the run does not continue bit for bit.", stacklevel=3)


# -- moving snapshots between workers -----------------------------------------------------------------------------

def gather_to_main(obj: Any) -> list[Any] | None:
    """Every worker's ``obj`` (tensors and plain values) on rank 0, in rank order; None elsewhere. Collective.

    See :func:`phalanx.group.collectives.gather_object`: device-aware, guarded, read back weights-only.
    """
    return gather_object(obj, 0, "every worker's state")


# -- copies --------------------------------------------------------------------------------------------------------

def cpu_copy(obj: Any) -> Any:
    """A detached CPU copy of nested tensors and containers (never a view of live state)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, cpu_copy(v)) for k, v in obj.items())  # keeps OrderedDict an OrderedDict
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def to_device(obj: Any, device: torch.device) -> Any:
    """Nested tensors moved to ``device`` (strategy state lives beside the parameters)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj




# -- fit, checked before anything is restored ----------------------------------------------------------------------

def optimizer_mismatch(saved: Any, live: dict[str, Any], optimizer: Any, saved_class: str | None = None) -> str | None:
    """Why the optimizer state ``saved`` does not fit ``optimizer`` (whose own state dict is ``live``); None if it does.

    Checked before anything is loaded, so that the state of another optimizer is refused with the model untouched
    rather than failing at the first step (AdamW's state loaded into ``SGD(momentum=0.9)`` has no ``momentum``):

    * the param groups: as many, each with the same parameters (names, or torch's indices in a one-file checkpoint);
    * the hyperparameters each group will have once loaded: torch takes them from the checkpoint and fills in only
      those a newer torch added (the optimizer's ``__setstate__``), so one this optimizer needs must be there.

    A parameter without saved state is no mismatch: an optimizer keeps none for a parameter that never had a gradient
    (or for a group with momentum 0), and it loads back as it was saved. ``saved_class``: the class that saved it,
    when the checkpoint records it (to name it).

    Example:
        >>> net = torch.nn.Linear(2, 1)
        >>> adamw, sgd = torch.optim.AdamW(net.parameters()), torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        >>> optimizer_mismatch(adamw.state_dict(), sgd.state_dict(), sgd, "AdamW")
        'it was saved from AdamW, whose param groups lack dampening, momentum, which this SGD needs'
        >>> optimizer_mismatch(sgd.state_dict(), sgd.state_dict(), sgd) is None
        True
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        return None  # another kind (a Keras optimizer's state): its own load_state_dict checks it
    mine = type(optimizer).__name__
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups) or not isinstance(saved.get("state"), dict):
        return f"its optimizer state is not torch's (param groups with their parameters, and a state), for this {mine}"
    theirs = groups, live["param_groups"]
    if len(theirs[0]) != len(theirs[1]):
        return (f"it holds {_groups(theirs[0])} and this {mine} has {_groups(theirs[1])}; build the same param groups")
    for i, (then, now) in enumerate(zip(*theirs)):
        if list(then["params"]) != list(now["params"]):
            return f"its param group {i} holds {_params(then)} and this {mine}'s holds {_params(now)}"
    needed = set().union(*(set(g) for g in theirs[1])) - {"params"}
    missing = sorted(needed - set().union(*(set(g) for g in _as_loaded(optimizer, groups))))
    if missing:
        by = saved_class or "an optimizer"
        return f"it was saved from {by}, whose param groups lack {', '.join(missing)}, which this {mine} needs"
    return None


def check_fit(where: str, optimizer: Any, saved_optimizer: Any, live_optimizer: Any, rng: Any = None,
              saved_class: str | None = None) -> None:
    """Refuse with one :class:`CheckpointError`, before anything is restored, the state of another optimizer
    (:func:`optimizer_mismatch`) and an RNG state that cannot be set (:func:`rng_problem`). ``where``: the checkpoint.

    Example:
        >>> net = torch.nn.Linear(2, 1); sgd = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> check_fit("ckpt", sgd, sgd.state_dict(), sgd.state_dict(), rng_state())
    """
    if optimizer is not None and saved_optimizer is not None:
        problem = optimizer_mismatch(saved_optimizer, live_optimizer, optimizer, saved_class)
        if problem:
            raise CheckpointError(f"{where!r} holds the state of another optimizer: {problem}. Build the optimizer "
                                  "that saved it (its class and param groups) before loading; nothing was changed.")
    problem = rng_problem(rng) if rng is not None else None
    if problem:
        raise CheckpointError(f"{where!r} holds an RNG state that cannot be restored ({problem}); expected the "
                              "generators' state px.save_checkpoint writes. Resume from an earlier checkpoint, or "
                              "with restore_rng=False; nothing was changed.")


def _as_loaded(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The param groups ``optimizer`` would have after loading ``groups`` (what its ``__setstate__`` fills in)."""
    probe = object.__new__(type(optimizer))
    try:  # on a bare instance of the same class: the optimizer itself is not touched
        probe.__setstate__({"defaults": dict(optimizer.defaults), "state": {},
                            "param_groups": [{**g, "params": []} for g in groups]})
        return list(probe.param_groups)
    except Exception:  # noqa: BLE001 - a class whose __setstate__ needs more: the groups as saved
        return groups


def _groups(groups: list[dict[str, Any]]) -> str:
    sizes = ", ".join(str(len(g["params"])) for g in groups)
    return f"{len(groups)} param group(s) of {sizes} parameter(s)"


def _params(group: dict[str, Any]) -> str:
    names = [str(p) for p in group["params"]]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"{len(names)} parameter(s) ({shown})" if names else "no parameters"


def rng_problem(state: Any) -> str | None:
    """Why ``state`` (from :func:`rng_state`) cannot be restored; None if it can. Tried, then put back as it was.

    Example:
        >>> rng_problem(rng_state()) is None, rng_problem({"torch": torch.zeros(3)}) is not None
        (True, True)
    """
    current = rng_state()
    try:
        set_rng_state(state)
    except Exception as err:  # noqa: BLE001 - whatever a crafted value makes torch, numpy or random raise
        text = next(iter(str(err).strip().splitlines()), "")
        return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__
    finally:
        set_rng_state(current)
    return None


# -- random number generators --------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """This worker's RNG states (Python, NumPy, torch, CUDA) as tensors and plain values."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(), "python": [version, list(internal), gauss],
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(np_gauss)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state((np_state["name"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


__all__ = ["FORMAT", "PER_WORKER", "TrainingState", "check_fit", "cpu_copy", "gather_to_main", "optimizer_mismatch",
           "rng_problem", "rng_state", "set_rng_state", "shared", "to_device"]
