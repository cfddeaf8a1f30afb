"""Downpour SGD (Dean et al. 2012) on the parameter servers: each worker pushes its gradients and pulls the
parameters on its own schedule, never waiting for another worker.

Example (one worker, a colocated server in this process):
    >>> import torch, phalanx as px
    >>> net = torch.nn.Linear(4, 2)
    >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=px.Downpour())
    >>> opt.zero_grad(); model(torch.randn(8, 4)).sum().backward(); opt.step()
    >>> px.strategy_of(opt).finish()
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from .. import check
from ..strategies import sync
from ..strategies.gradients import local_grads
from .optim import from_torch_sgd, server_rule
from .shards import Policy
from .strategy import PSStrategy


class Downpour(PSStrategy):
    """Asynchronous SGD with sharded parameter servers (Dean et al. 2012).

    Every ``push_every`` local steps the worker sends the gradients it summed since its last
    push. The servers apply them with ``server_optimizer``, which defaults to SGD at the
    lr of your optimizer; Dean et al. preferred ``phalanx.ps.Adagrad``. Every
    ``pull_every`` steps the worker replaces its parameters with the servers'. Between
    pulls your own optimizer moves the local copy.

    Args:
        push_every, pull_every: steps between pushes / pulls (n_push and n_fetch in the paper).
        server_optimizer: ``phalanx.ps.SGD(lr)`` or ``phalanx.ps.Adagrad(lr)``. Left unset, the
            servers apply your ``torch.optim.SGD``'s rule: its momentum, weight decay and
            nesterov (one setting for all groups; the momentum buffer lives on the servers),
            and the current lr of each parameter's group, sent with every push, so LR
            schedules and per-group lrs are followed. Any other optimizer, or what the
            servers cannot apply (dampening, maximize, groups with different momentum), is
            refused at ``px.wrap`` with what to do instead, never silently dropped.
        max_staleness: drop (and count in ``self.dropped``, per shard) a push computed from parameters more
            than this many versions behind the shard's; None applies every push.
        lock: serialise updates of each shard (True), or let them interleave, Hogwild style (False).
    """

    name = "downpour"

    def __init__(self, push_every: int = 1, pull_every: int = 1, *, server_optimizer: Any = None,
                 max_staleness: int | None = None, lock: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.push_when, self.pull_when = sync.every(push_every), sync.every(pull_every)
        self.server_optimizer = server_rule(server_optimizer)
        if max_staleness is not None:
            check.integer("max_staleness", max_staleness, "Leave it None for no limit; 0 applies only pushes "
                          "computed from the shard's current version.")
        self.max_staleness, self.lock = max_staleness, bool(lock)
        self.dropped = 0  # shard updates the servers refused as too stale
        self._acc: list[torch.Tensor] | None = None

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        # Left unset, the servers apply your SGD (lr sent with every push, so schedules hold).
        self._rule = self.server_optimizer or from_torch_sgd(optimizer)

    def join(self) -> None:
        rule = self._rule
        # Pushes carry the user's lrs only while the servers apply the user's rule.
        self._sends_lr = self.server_optimizer is None
        if not self.table.register(Policy(rule, self.lock, self.max_staleness)):  # type: ignore[union-attr]
            self._sends_lr = False  # a late joiner: the first worker's rule is in force, with its own lr
            warnings.warn("the servers already hold these parameters under another policy (server optimizer, lock "
                          "or max_staleness); theirs stays in force", stacklevel=3)
        if self.push_when.k > 1:
            self._acc = [torch.zeros_like(p) for p in self.params]
        self._unpushed = False
        self._reached = [False] * len(self.params)  # which parameters the unpushed gradients touched

    def _lrs(self) -> list[float] | None:
        """Each parameter's current lr (its group's), when the servers follow the user's optimizer."""
        if not getattr(self, "_sends_lr", False):
            return None
        by_param = {id(p): float(g["lr"]) for g in self.optimizer.param_groups for p in g["params"]}
        return [by_param[id(p)] for p in self.params]

    def after_step(self, step: int, taken: bool) -> None:
        push, pull = self.push_when(step), self.pull_when(step)
        grads: list[torch.Tensor] | None
        if taken:
            grads, flags = local_grads(self.params)
            self._reached = [a or bool(f) for a, f in zip(self._reached, flags.tolist(), strict=True)]
            if self._acc is not None:
                for acc, g in zip(self._acc, grads, strict=True):
                    acc.add_(g)
                grads, self._unpushed = self._acc, True
        else:  # skipped here (GradScaler found inf): no gradient from this step; the schedule still counts it
            grads = self._acc if self._unpushed else None
        if push and grads is not None:
            self._push(grads, pull=pull)
            self._unpushed = False
        elif pull:
            self._exchange(self.table.pull)  # type: ignore[union-attr]

    def _push(self, grads: list[torch.Tensor], *, pull: bool) -> None:
        # Only what some gradient touched: a parameter with none keeps its value on the servers, as in one process.
        self.dropped += self._exchange(self.table.push, grads, pull=pull, lrs=self._lrs(),  # type: ignore
                                       reached=self._reached)
        self._reached = [False] * len(self.params)
        if self._acc is not None:
            for acc in self._acc:
                acc.zero_()

    def _flush(self) -> None:
        if self._acc is not None and getattr(self, "_unpushed", False):
            self._push(self._acc, pull=False)
            self._unpushed = False

    def replica_state_dict(self) -> dict[str, Any]:
        """This worker's own: the gradient sum it has not pushed yet, the versions it last pulled, its drop count."""
        return {**super().replica_state_dict(), "dropped": self.dropped,
                "acc": [a.clone() for a in self._acc] if self._acc is not None else None,
                "unpushed": getattr(self, "_unpushed", False), "reached": list(getattr(self, "_reached", [])),
                "versions": dict(self.table.versions) if self.table is not None else None}

    def load_replica_state_dict(self, state: dict[str, Any]) -> None:
        super().load_replica_state_dict(state)
        self.dropped = int(state.get("dropped", 0))
        self._unpushed = bool(state.get("unpushed", False))
        if len(state.get("reached", [])) == len(self.params):
            self._reached = [bool(r) for r in state["reached"]]
        if state.get("acc") is not None and self._acc is not None:
            for acc, saved in zip(self._acc, state["acc"], strict=True):
                acc.copy_(saved)
        if state.get("versions") is not None and self.table is not None:
            self.table.versions.update({k: int(v) for k, v in state["versions"].items() if k in self.table.versions})

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(push_every={self.push_when.k}, pull_every={self.pull_when.k}, "
                f"server_optimizer={self.server_optimizer!r}, max_staleness={self.max_staleness})")


__all__ = ["Downpour"]
