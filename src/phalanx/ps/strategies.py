"""Parameter-server strategies: Downpour, asynchronous EASGD and synchronous PS.

They plug into ``px.wrap`` like any strategy. Downpour and asynchronous EASGD never use
a collective among workers. Each worker talks to the servers on its own schedule, so
a slow or dead worker holds no one else up, and a worker started late simply joins: it
registers nothing new and pulls the current parameters.

Example (one worker, a colocated server in this process):
    >>> import torch, phalanx as px
    >>> net = torch.nn.Linear(4, 2)
    >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=px.Downpour())
    >>> opt.zero_grad(); model(torch.randn(8, 4)).sum().backward(); opt.step()
    >>> px.strategy_of(opt).finish()
"""
from __future__ import annotations

import math
import time
import warnings
from typing import Any, Sequence

import torch
from torch import nn

from .. import group, sync
from ..errors import ConfigError, usage
from ..strategies import register
from ..strategies.base import Strategy
from .client import ParamTable
from .link import Link, connect
from .optim import SGD, Adagrad
from .placement import policy as placement_policy
from .shards import Policy


class PSStrategy(Strategy):
    """What every PS strategy shares: connect, shard the parameters, account the traffic.

    Args:
        servers: None (``PHALANX_PS_ADDRS``, else colocated), "colocated", or a list of addresses.
        placement: "greedy_bytes" (default), "round_robin", or a policy object.
        timeout: seconds to wait for a server (default ``PHALANX_PS_TIMEOUT`` or 30).
    """

    def __init__(self, *, servers: str | Sequence[str] | None = None, placement: Any = "greedy_bytes",
                 timeout: float | None = None) -> None:
        super().__init__()
        self.servers, self.placement, self.timeout = servers, placement_policy(placement), timeout
        if timeout is not None and not timeout > 0:
            raise ConfigError(usage(f"timeout={timeout!r}", "a positive number of seconds", "Leave it unset for 30."))
        self.link: Link | None = None
        self.table: ParamTable | None = None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        # No broadcast here (unlike the base class): the servers are where replicas agree.
        self.model, self.optimizer = model, optimizer
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.link = connect(self.servers, timeout=self.timeout)
        self.table = ParamTable(named, self.link.client, self.placement)
        self._exchange(self.join)
        self._attach_mark = (self.comm.stats.bytes_sent, self.steps)  # bytes_per_step leaves out the join
        return model

    def join(self) -> None:
        """Agree on the starting parameters (runs inside attach)."""

    #: The servers hold the trained model (Downpour's parameters, EASGD's centre): finish() pulls it.
    servers_hold_the_model = True

    def finish(self) -> None:
        """End of training: pull the servers' model into the local one, then leave the servers.

        A colocated server keeps serving until every worker has called this (or exited).
        """
        if self.link is None or self.link.released:
            return
        if self.servers_hold_the_model:
            self._exchange(self.table.pull)  # type: ignore[union-attr]
        self.link.release()

    def _exchange(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one exchange with the servers and add its bytes and time to ``self.comm.stats``."""
        traffic = self.link.client.traffic  # type: ignore[union-attr]
        sent, start = sum(traffic.bytes_sent), time.perf_counter()
        result = fn(*args, **kwargs)
        self.comm.stats.bytes_sent += sum(traffic.bytes_sent) - sent
        self.comm.stats.seconds += time.perf_counter() - start
        self.comm.stats.calls += 1
        return result

    def _grads(self) -> list[torch.Tensor]:
        """Every parameter's gradient; a parameter the loss did not touch gets zeros."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]  # type: ignore[misc]


def _rule(server_optimizer: Any) -> "SGD | Adagrad | None":
    if server_optimizer is not None and not isinstance(server_optimizer, (SGD, Adagrad)):
        raise ConfigError(usage(f"server_optimizer={server_optimizer!r}",
                                "phalanx.ps.SGD(lr) or phalanx.ps.Adagrad(lr)",
                                "Leave it unset to apply your optimizer's lr with plain SGD on the servers."))
    return server_optimizer


class Downpour(PSStrategy):
    """Asynchronous SGD with sharded parameter servers (Dean et al. 2012).

    Every ``push_every`` local steps the worker sends the gradients it summed since its last
    push. The servers apply them with ``server_optimizer``, which defaults to SGD at the
    lr of your optimizer; Dean et al. preferred ``phalanx.ps.Adagrad``. Every
    ``pull_every`` steps the worker replaces its parameters with the servers'. Between
    pulls your own optimizer moves the local copy.

    Args:
        push_every, pull_every: steps between pushes / pulls (n_push and n_fetch in the paper).
        server_optimizer: ``phalanx.ps.SGD(lr)`` or ``phalanx.ps.Adagrad(lr)``.
        max_staleness: drop (and count in ``self.dropped``, per shard) a push computed from parameters more
            than this many versions behind the shard's; None applies every push.
        lock: serialise updates of each shard (True), or let them interleave, Hogwild style (False).
    """

    name = "downpour"

    def __init__(self, push_every: int = 1, pull_every: int = 1, *, server_optimizer: Any = None,
                 max_staleness: int | None = None, lock: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.push_when, self.pull_when = sync.every(push_every), sync.every(pull_every)
        self.server_optimizer = _rule(server_optimizer)
        if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                          or max_staleness < 0):
            raise ConfigError(usage(f"max_staleness={max_staleness!r}", "None or an integer >= 0",
                                    "0 applies only pushes computed from the shard's current version."))
        self.max_staleness, self.lock = max_staleness, bool(lock)
        self.dropped = 0  # shard updates the servers refused as too stale
        self._acc: list[torch.Tensor] | None = None

    def join(self) -> None:
        rule = self.server_optimizer or SGD(lr=self.optimizer.param_groups[0]["lr"])
        if not self.table.register(Policy(rule, self.lock, self.max_staleness)):  # type: ignore[union-attr]
            warnings.warn("the servers already hold these parameters under another policy (server optimizer, lock "
                          "or max_staleness); theirs stays in force", stacklevel=3)
        if self.push_when.k > 1:
            self._acc = [torch.zeros_like(p) for p in self.params]

    def after_step(self, step: int, taken: bool) -> None:
        if not taken:
            return  # this rank skipped the step (e.g. GradScaler found inf): nothing to push
        grads = self._grads()
        if self._acc is not None:
            for acc, g in zip(self._acc, grads, strict=True):
                acc.add_(g)
            grads = self._acc
        push, pull = self.push_when(step), self.pull_when(step)
        if push:
            self.dropped += self._exchange(self.table.push, grads, pull=pull)  # type: ignore[union-attr]
            if self._acc is not None:
                for acc in self._acc:
                    acc.zero_()
        elif pull:
            self._exchange(self.table.pull)  # type: ignore[union-attr]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "dropped": self.dropped, "acc": self._acc}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.dropped = int(state.get("dropped", 0))
        if state.get("acc") is not None and self._acc is not None:
            for acc, saved in zip(self._acc, state["acc"], strict=True):
                acc.copy_(saved)
        if self.table is not None:  # the servers hold the truth; resync versions with them
            self._exchange(self.table.pull)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(push_every={self.push_when.k}, pull_every={self.pull_when.k}, "
                f"server_optimizer={self.server_optimizer!r}, max_staleness={self.max_staleness})")


class AsyncEASGD(PSStrategy):
    """Asynchronous elastic averaging SGD (Zhang, Choromanska and LeCun 2015), centre on the servers.

    Every ``every`` local steps (τ), in one round trip per server: ``d = α(x − c)``,
    ``c ← c + d`` on the server, and ``x ← x − d`` on the worker. The trained model is the
    centre. :meth:`finish` loads it into the local model.

    Args:
        every: τ, local steps between elastic moves (the paper uses 1 to 64).
        alpha: the elastic force, 0 < α < 1; default 0.9 / number of workers (β = pα = 0.9).
        lock: serialise the centre's updates (the paper's asynchronous rule assumes it).
    """

    name = "easgd-async"

    def __init__(self, every: int = 4, alpha: float | None = None, *, lock: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.when = sync.every(every)
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                                  or not math.isfinite(alpha) or not 0 < alpha < 1):
            raise ConfigError(usage(f"alpha={alpha!r}", "0 < alpha < 1 (the elastic force)",
                                    "The paper keeps alpha * workers near 0.9, e.g. alpha=0.45 for 2 workers."))
        self.alpha, self.lock = alpha, bool(lock)

    def join(self) -> None:
        if self.alpha is None:
            self.alpha = 0.9 / max(1, group.world_size())
        self.table.register(Policy(None, self.lock))  # type: ignore[union-attr]

    def after_step(self, step: int, taken: bool) -> None:
        if self.when(step):
            self._exchange(self.table.elastic, self.alpha)  # type: ignore[union-attr]

    def __repr__(self) -> str:
        return f"AsyncEASGD(every={self.when.k}, alpha={self.alpha})"


class SyncParameterServer(PSStrategy):
    """Synchronous PS: each step the servers average all workers' gradients; your optimizer steps.

    Workers start from rank 0's parameters and all apply the same mean gradient, so the
    result equals ``px.AllReduce()`` for any optimizer. Here the servers act as reducers:
    the weights live on the workers. A dead worker stops the others, which get a
    :class:`~phalanx.ps.client.ServerUnreachable` error after the timeout, since a
    synchronous round cannot finish without it.
    """

    name = "ps-sync"
    servers_hold_the_model = False  # the servers only reduce; the weights live on the workers

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        # Replicas start identical, as under AllReduce: a one-off collective at attach, never per step.
        self.comm.broadcast_([t.data for t in model.state_dict(keep_vars=True).values()])
        return super().attach(model, optimizer)

    def after_backward(self, step: int) -> None:
        self._exchange(self.table.reduce, self._grads(), step=step - 1,  # type: ignore[union-attr]
                       workers=group.world_size())

    def __repr__(self) -> str:
        return "ParameterServer(sync=True)"


def ParameterServer(sync: bool = True, **kwargs: Any) -> PSStrategy:  # noqa: N802 - reads as a strategy class
    """``sync=True``: :class:`SyncParameterServer`; ``sync=False``: ``Downpour(push_every=1, pull_every=1)``.

    Keyword arguments go to that class (``servers``, ``placement``, ``timeout``; the
    asynchronous one also takes Downpour's).
    """
    if not sync:
        return Downpour(1, 1, **kwargs)
    if set(kwargs) - {"servers", "placement", "timeout"}:
        raise ConfigError(usage(f"ParameterServer(sync=True, {', '.join(sorted(kwargs))}=...)",
                                "only servers, placement and timeout in synchronous mode",
                                "Use px.Downpour(...) for asynchronous knobs."))
    return SyncParameterServer(**kwargs)


register("downpour", Downpour)
register("easgd-async", AsyncEASGD)
register("ps-sync", SyncParameterServer)
