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

import time
import warnings
from typing import Any, Sequence

import torch
from torch import nn

from .. import check
from ..group import group
from ..strategies import sync
from ..errors import ConfigError, usage
from ..group.env import WorkerEnv
from ..strategies.accounting import Accounting
from ..strategies.base import StepState, Strategy
from ..strategies.gradients import local_grads, set_averaged_grads_
from ..strategies.allreduce import rebuilt
from .client import ParamTable
from .elastic import FollowsElasticGroup
from .link import Link, connect, follow_group
from .optim import from_torch_sgd, server_rule
from .placement import policy as placement_policy
from .shards import Policy
from .wire import require_zmq


class PSStrategy(FollowsElasticGroup, Accounting, StepState, Strategy):
    """What every PS strategy shares: connect, shard the parameters, account the traffic.

    Args:
        servers: None (``PHALANX_PS_ADDRS``, else colocated), "colocated", or a list of addresses.
        placement: "greedy_bytes" (default), "round_robin", or a policy object.
        timeout: seconds to wait for a server (default ``PHALANX_PS_TIMEOUT`` or 30).
    """

    def __init__(self, *, servers: str | Sequence[str] | None = None, placement: Any = "greedy_bytes",
                 timeout: float | None = None) -> None:
        require_zmq()  # fail here, with what to install, rather than deep inside attach
        super().__init__()
        if timeout is not None:
            timeout = check.positive_float("timeout", timeout, "Leave it unset for 30 seconds.")
        self.servers, self.placement, self.timeout = servers, placement_policy(placement), timeout
        self.link: Link | None = None
        self.table: ParamTable | None = None
        self._pending_servers: dict[str, Any] | None = None  # a checkpoint loaded before attach

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        # No broadcast here (unlike the base class): the servers are where replicas agree.
        self.model, self.optimizer = model, optimizer
        self.check_optimizer(optimizer)  # before anything starts: a refusal leaves no server behind
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.link = connect(self.servers, timeout=self.timeout)
        self.table = ParamTable(named, self.link.client, self.placement)
        self._exchange(self.join)
        self.watch_servers()
        if self._pending_servers is not None:
            self._restore_servers(self._pending_servers)
            self._pending_servers = None
        self._attach_mark = (self.comm.stats.bytes_sent, self.steps)  # bytes_per_step leaves out the join
        return model

    def launched_with(self, env: WorkerEnv) -> None:
        """``px.wrap`` tells this rule what ``phalanx run`` set up (a :class:`phalanx.strategies.base.ServerBacked`
        rule): the servers of ``--servers N`` are this rule's (``connect`` finds them at attach)."""

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse, at wrap time, an optimizer this strategy cannot honour (the default accepts any)."""

    def join(self) -> None:
        """Agree on the starting parameters (runs inside attach)."""

    #: The servers hold the trained model (Downpour's parameters, EASGD's centre): finish() pulls it.
    servers_hold_the_model = True

    def finish(self) -> None:
        """Close a skipped last step, then :meth:`reconcile` (on every worker)."""
        super().finish()
        self.reconcile()

    def reconcile(self) -> None:
        """End of training, on every worker: leave each one holding the same final model.

        Each worker sends what it has not pushed yet, then waits (through the rendezvous
        store, at most the PS timeout) until every worker has done so, then pulls. So every
        worker ends with the servers' model including everyone's last updates. A worker that
        never arrives is named in a warning, and the others pull without its last updates.
        A colocated server keeps serving until every worker has called this (or exited).
        """
        if self.link is None or self.link.released:
            return
        if self.servers_hold_the_model:
            self._flush()
            self.link.barrier("finish() waited for every worker's last pushes", strict=False)
            self._exchange(self.table.pull)  # type: ignore[union-attr]
        self.link.release()

    def _flush(self) -> None:
        """Send what this worker has not pushed yet (Downpour's partial gradient sum)."""

    # -- state: the servers' shards are part of the shared state ------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The step count and, when the servers hold the model, their shards (values, versions, rule state)."""
        state = super().state_dict()
        if self.servers_hold_the_model and self.table is not None and not self.link.released:  # type: ignore
            state["servers"] = self._exchange(self.table.snapshot)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step count and make the servers hold the saved shards.

        Rank 0 sends them (one ``set`` request per server); every worker then waits at a
        store barrier, so no one pushes to the servers before they hold the checkpoint.
        """
        super().load_state_dict(state)
        servers = state.get("servers")
        if servers is None or not self.servers_hold_the_model:
            return
        if self.table is None:
            self._pending_servers = servers  # applied at attach
            return
        self._restore_servers(servers)

    def replica_state_dict(self) -> dict[str, Any]:
        """When the servers hold the model, each worker's copy drifts from it: keep the copy and its optimizer."""
        state: dict[str, Any] = {}
        if self.servers_hold_the_model:
            state.update(params=[p.detach().clone() for p in self.params], optimizer=self.optimizer.state_dict())
        return state

    def load_replica_state_dict(self, state: dict[str, Any]) -> None:
        if "params" in state:
            with torch.no_grad():
                for p, saved in zip(self.params, state["params"], strict=True):
                    p.copy_(saved)
            self.optimizer.load_state_dict(state["optimizer"])

    def _restore_servers(self, servers: dict[str, Any]) -> None:
        if group.rank() == 0:
            self._servers_back(register=True)  # a restarted server knows neither our shards nor their rule
            self._exchange(self.table.set, servers)  # type: ignore[union-attr]
        else:
            self.table.versions = {n: int(e["version"]) for n, e in servers.items()}  # type: ignore[union-attr]
        if not self._regroup_pending():  # a rollback's barrier is the one in regroup(), which joiners pass too
            self.link.barrier("restoring the parameter servers from a checkpoint")  # type: ignore[union-attr]

    def _exchange(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one exchange with the servers and add its bytes and time to ``self.comm.stats``."""
        traffic = self.link.client.traffic  # type: ignore[union-attr]
        sent, start = sum(traffic.bytes_sent), time.perf_counter()
        result = fn(*args, **kwargs)
        self.comm.stats.bytes_sent += sum(traffic.bytes_sent) - sent
        self.comm.stats.seconds += time.perf_counter() - start
        self.comm.stats.calls += 1
        return result


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
        if alpha is not None:
            check.number("alpha", alpha, "The paper keeps alpha * workers near 0.9, e.g. alpha=0.45 for 2 workers.",
                         low=0, high=1, expected="0 < alpha < 1 (the elastic force)")
        self.alpha, self.lock = alpha, bool(lock)
        self._default_alpha = alpha is None  # then it follows the world size

    def join(self) -> None:
        if self._default_alpha:
            self.alpha = 0.9 / max(1, group.world_size())
        self.table.register(Policy(None, self.lock))  # type: ignore[union-attr]

    def regroup(self) -> None:
        """Under ``--elastic``, after a change: the default alpha follows the new p (beta = p * alpha stays 0.9)."""
        super().regroup()
        if self._default_alpha:
            self.alpha = 0.9 / max(1, group.world_size())

    def after_step(self, step: int, taken: bool) -> None:
        if self.when(step):
            self._exchange(self.table.easgd, self.alpha)  # type: ignore[union-attr]

    def __repr__(self) -> str:
        return f"AsyncEASGD(every={self.when.k}, alpha={self.alpha})"


class SyncParameterServer(PSStrategy):
    """Synchronous PS: each step the servers average all workers' gradients; your optimizer steps.

    Workers start from rank 0's parameters and all apply the same mean gradient, so the
    result equals ``px.AllReduce()`` for any optimizer. Here the servers act as reducers:
    the weights live on the workers. Gradients are averaged inside ``backward()``, so
    gradient clipping and GradScaler see the mean, as under AllReduce. A dead worker stops
    the others: the servers abandon the round it never joined after ``PHALANX_PS_TIMEOUT``
    and tell the waiting workers, which raise :class:`~phalanx.ps.client.PSError` naming it.
    Under ``--elastic`` they regroup instead (see :meth:`regroup`).
    """

    name = "ps-sync"
    uneven_batches = True  # the servers average batch-weighted gradients, as AllReduce does
    servers_hold_the_model = False  # the servers only reduce; the weights live on the workers

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        # Replicas start identical, as under AllReduce: a one-off collective at attach, never per step.
        self.comm.broadcast_([t.data for t in model.state_dict(keep_vars=True).values()])
        return super().attach(model, optimizer)

    def join(self) -> None:
        # The servers only average, but they accept a tensor only under a registered name and shape.
        self.table.register(Policy(None))  # type: ignore[union-attr]

    def weighs_gradients(self, step: int) -> bool:
        return True

    def after_backward(self, step: int) -> None:
        """Inside ``backward()``: replace every gradient by the mean over all workers (batch-weighted).

        Non-finite gradients are averaged like any other, so when GradScaler finds inf on one
        rank, every rank sees it in the mean and skips that step, as under ``px.AllReduce``.
        """
        # Weighted by this rank's batch share as backward accumulated them (phalanx.step.clock). The flags say which
        # parameters had a gradient here; one no rank reached keeps grad None, as in one process.
        grads, flags = local_grads(self.params)
        g = group.current()  # under --elastic a round belongs to one generation; a dead peer ends the wait
        elastic = {"generation": g.generation,
                   "abandon": lambda: _lost(g) or self.server_restarted()} if rebuilt(g) else {}
        self._exchange(self.table.reduce, grads, step=step - 1,  # type: ignore[union-attr]
                       workers=group.world_size(), **elastic)
        self.comm.all_reduce_([flags])  # a few bytes over the workers' own group (the servers take named tensors)
        set_averaged_grads_(self.params, grads, flags)

    def regroup(self) -> None:
        """Under ``--elastic``: rounds now count the new group; colocated servers follow it (re-placed)."""
        link = follow_group(self.link, self.servers, self.timeout)  # type: ignore[arg-type]
        if link is not self.link:
            named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
            self.link, self.table = link, ParamTable(named, link.client, self.placement)
            self._exchange(self.join)
        else:
            self._servers_back(register=True)  # a restarted server must know the names again

    def __repr__(self) -> str:
        return "ParameterServer(sync=True)"


def _lost(g: group.Group) -> str | None:
    """Why a member of the current generation will never send its part of a synchronous round, or None."""
    lost = g.lost_peers()
    if not lost:
        return None
    return (f"rank(s) {', '.join(map(str, lost))} of generation {g.generation} died during a synchronous "
            "parameter-server round")


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

