"""Server-side optimizers: what a server does with a pushed gradient.

Dean et al. (2012) found Downpour worked best with Adagrad on the servers, each
parameter getting its own step size. Rules travel to the servers as a small JSON spec
(``{"kind": "adagrad", "lr": 0.05, ...}``), never as code.

Example:
    >>> import torch
    >>> rule = Adagrad(lr=0.5); p = torch.ones(2); state = rule.init_state(p)
    >>> rule.apply_(p, torch.tensor([1.0, -1.0]), state); p
    tensor([0.5000, 1.5000])
"""
from __future__ import annotations

from typing import Any

import torch

from .. import check
from ..errors import ConfigError, usage


class SGD:
    """``torch.optim.SGD``'s rule on the server: ``d = g + wd·p; b ← μ·b + d; p ← p − lr·(d + μ·b if nesterov else b)``.

    With the defaults (no momentum, no weight decay) it is ``p ← p − lr·g``, plain
    asynchronous SGD. The momentum buffer lives on the server, one per shard, and
    every worker's pushes feed it (asynchronous momentum).
    """

    kind = "sgd"

    def __init__(self, lr: float, *, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False) -> None:
        self.lr = check.positive_float("lr", lr, "Pass the server's step size, e.g. SGD(lr=0.05).")
        momentum = check.number("momentum", momentum, "Use 0.9, or 0 for none.", low=0, high=1, low_open=False)
        weight_decay = check.number("weight_decay", weight_decay, "Use e.g. 1e-4.", low=0, low_open=False)
        if nesterov and not momentum:
            raise ConfigError(usage("nesterov=True without momentum", "momentum > 0", "Pass momentum=0.9."))
        self.momentum, self.weight_decay, self.nesterov = float(momentum), float(weight_decay), bool(nesterov)

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        # A zero buffer makes the first step b = d, as torch's SGD does (it has no dampening here).
        return {"momentum_buffer": torch.zeros_like(param)} if self.momentum else {}

    def apply_(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
               lr: float | None = None) -> None:
        """``lr``: the worker's current learning rate, when it sends one (its schedule); else ``self.lr``."""
        d = grad.add(param, alpha=self.weight_decay) if self.weight_decay else grad
        if self.momentum:
            buf = state["momentum_buffer"]
            buf.mul_(self.momentum).add_(d)
            d = d.add(buf, alpha=self.momentum) if self.nesterov else buf
        param.add_(d, alpha=-(self.lr if lr is None else lr))

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                "nesterov": self.nesterov}

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in (("momentum", self.momentum), ("weight_decay", self.weight_decay),
                                                  ("nesterov", self.nesterov)) if v)
        return f"SGD(lr={self.lr}{extra})"


class Adagrad:
    """``a ← a + g²; p ← p − lr·g / (√a + eps)``: per-coordinate step sizes (Duchi et al. 2011)."""

    kind = "adagrad"

    def __init__(self, lr: float, *, eps: float = 1e-10, initial_accumulator: float = 0.0) -> None:
        self.lr = check.positive_float("lr", lr, "Pass the server's step size, e.g. Adagrad(lr=0.05).")
        self.eps = check.positive_float("eps", eps, "Keep the default 1e-10 unless you have a reason.")
        self.initial_accumulator = check.number("initial_accumulator", initial_accumulator, "Keep the default 0.",
                                                low=0, low_open=False)

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"sum": torch.full_like(param, self.initial_accumulator)}

    def apply_(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
               lr: float | None = None) -> None:
        acc = state["sum"]
        acc.addcmul_(grad, grad)
        param.addcdiv_(grad, acc.sqrt().add_(self.eps), value=-self.lr)

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "lr": self.lr, "eps": self.eps, "initial_accumulator": self.initial_accumulator}

    def __repr__(self) -> str:
        return f"Adagrad(lr={self.lr})"


RULES = {SGD.kind: SGD, Adagrad.kind: Adagrad}


def from_spec(spec: Any) -> "SGD | Adagrad":
    """Rebuild a rule from its JSON spec; anything unexpected is a :class:`ConfigError`."""
    if not isinstance(spec, dict) or spec.get("kind") not in RULES:
        raise ConfigError(usage(f"server optimizer spec {spec!r}", "kind one of " + ", ".join(RULES),
                                "Use phalanx.ps.SGD(lr) or phalanx.ps.Adagrad(lr)."))
    kwargs = {k: v for k, v in spec.items() if k != "kind"}
    try:
        return RULES[spec["kind"]](**kwargs)
    except TypeError as err:
        raise ConfigError(usage(f"server optimizer spec {spec!r}", "only the rule's own fields", str(err))) from None


def from_torch_sgd(optimizer: torch.optim.Optimizer) -> SGD:
    """The server-side copy of the user's ``torch.optim.SGD``; refuse what it cannot apply, never drop it."""
    todo = ("Use torch.optim.SGD (momentum, weight_decay, nesterov and an LR scheduler are followed), or choose the "
            "servers' rule yourself with server_optimizer=px.ps.Adagrad(lr=...) or px.ps.SGD(lr=...); your "
            "optimizer then only moves the local copy between pulls.")
    if type(optimizer) is not torch.optim.SGD:
        raise ConfigError(usage(f"Downpour with a {type(optimizer).__name__} optimizer and no server_optimizer",
                                "torch.optim.SGD, whose rule the servers apply", todo))
    groups = optimizer.param_groups
    for i, g in enumerate(groups):
        if g.get("dampening") or g.get("maximize"):
            raise ConfigError(usage(f"Downpour with SGD(dampening={g.get('dampening')}, maximize={g.get('maximize')})"
                                    f" in param group {i} and no server_optimizer",
                                    "dampening=0 and maximize=False (the servers' rule has neither)", todo))
    keys = ("momentum", "weight_decay", "nesterov")
    settings = {tuple(g.get(k) for k in keys) for g in groups}
    if len(settings) > 1:
        raise ConfigError(usage(f"Downpour with param groups whose {'/'.join(keys)} differ ({sorted(settings)})",
                                "one setting for every group (each push carries its group's lr; nothing else)",
                                "Give every group the same momentum, weight_decay and nesterov, " + todo[0].lower()
                                + todo[1:]))
    momentum, weight_decay, nesterov = settings.pop()
    return SGD(lr=max(g["lr"] for g in groups) or 1.0, momentum=momentum or 0.0, weight_decay=weight_decay or 0.0,
               nesterov=bool(nesterov))


def server_rule(server_optimizer: Any) -> "SGD | Adagrad | None":
    """Downpour's ``server_optimizer``, checked: a :class:`SGD`, an :class:`Adagrad`, or None (yours)."""
    if server_optimizer is not None and not isinstance(server_optimizer, (SGD, Adagrad)):
        raise ConfigError(usage(f"server_optimizer={server_optimizer!r}",
                                "phalanx.ps.SGD(lr) or phalanx.ps.Adagrad(lr)",
                                "Leave it unset to apply your optimizer's lr with plain SGD on the servers."))
    return server_optimizer
