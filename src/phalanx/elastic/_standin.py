"""Stand-in for ``phalanx.state.TrainingState`` (contract 2) until that module is merged.

capture() -> dict: this rank's snapshot, detached CPU copies, no collective.
restore(snapshot): apply it; the loader position is world-size independent and
re-split over the *current* world size.
"""
from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import torch

from .. import group
from ..data import ShardedLoader, global_batches
from ..wrap import strategy_of, unwrap


def _cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return copy.deepcopy(obj)


class TrainingState:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 loader: Any = None, scheduler: Any = None, scaler: Any = None, extra: dict | None = None) -> None:
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.scheduler, self.scaler, self.extra = scheduler, scaler, dict(extra or {})

    def capture(self) -> dict:
        strategy = strategy_of(self.optimizer) if self.optimizer is not None else None
        snap: dict[str, Any] = {"model": _cpu(unwrap(self.model).state_dict())}
        if self.optimizer is not None:
            snap["optimizer"] = _cpu(self.optimizer.state_dict())
        if strategy is not None:
            snap["strategy"] = _cpu(strategy.state_dict())
            snap["replica"] = _cpu(strategy.replica_state_dict())
        if isinstance(self.loader, ShardedLoader):
            snap["loader"] = _position(self.loader)
        for name in ("scheduler", "scaler"):
            if getattr(self, name) is not None:
                snap[name] = _cpu(getattr(self, name).state_dict())
        snap["extra"] = {k: _cpu(v.state_dict()) for k, v in self.extra.items()}
        snap["rng"] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        return snap

    def restore(self, snap: dict) -> None:
        unwrap(self.model).load_state_dict(snap["model"])
        strategy = strategy_of(self.optimizer) if self.optimizer is not None else None
        if "optimizer" in snap:
            self.optimizer.load_state_dict(snap["optimizer"])
        if strategy is not None:
            strategy.load_state_dict(snap["strategy"])
            if snap.get("replica"):
                strategy.load_replica_state_dict(snap["replica"])
        if "loader" in snap:
            _resplit(self.loader, snap["loader"])
        for name in ("scheduler", "scaler"):
            if name in snap:
                getattr(self, name).load_state_dict(snap[name])
        for k, v in snap["extra"].items():
            self.extra[k].load_state_dict(v)
        random.setstate(snap["rng"]["python"])
        np.random.set_state(snap["rng"]["numpy"])
        torch.set_rng_state(snap["rng"]["torch"])


def _position(loader: ShardedLoader) -> dict:
    s = loader.sampler
    plan = s._plan()
    consumed = getattr(s, "_offset", 0) if getattr(s, "_offset_epoch", None) == s.epoch else 0
    consumed += sum(sum(len(p) for p in step) for step in plan[:s.position])
    return {"epoch": s.epoch, "consumed": consumed, "seed": s.seed}


def _resplit(loader: ShardedLoader, pos: dict) -> None:
    s = loader.sampler
    s.rank, s.world_size = group.rank(), group.world_size()
    s.epoch, s.seed, s.position = pos["epoch"], pos["seed"], 0
    s._offset, s._offset_epoch = pos["consumed"], pos["epoch"]

    def plan() -> list:
        offset = s._offset if s._offset_epoch == s.epoch else 0
        if s.shuffle:
            order = torch.randperm(s.n, generator=torch.Generator().manual_seed(s.seed + s.epoch)).tolist()
        else:
            order = list(range(s.n))
        rest = order[offset:]
        batches = global_batches(len(rest), s.batch_size, s.world_size, shuffle=False, seed=0, epoch=0,
                                 drop_last=s.drop_last)
        return [[[rest[i] for i in part] for part in step] for step in batches]

    s._plan = plan
