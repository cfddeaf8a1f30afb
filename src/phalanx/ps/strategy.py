"""What every parameter-server strategy shares: the link to the servers, the parameters sharded over them, the
traffic counted, the servers' state checkpointed (:class:`PSStrategy`).

Each rule is its own module: :mod:`.downpour` (asynchronous pushes and pulls), :mod:`.async_easgd` (an elastic
centre on the servers), :mod:`.sync_server` (a synchronous round through the servers, and ``px.ParameterServer``).
They plug into ``px.wrap`` like any strategy. Downpour and asynchronous EASGD never use a collective among workers.
Each worker talks to the servers on its own schedule, so a slow or dead worker holds no one else up, and a worker
started late simply joins: it registers nothing new and pulls the current parameters.

Example (one worker, a colocated server in this process):
    >>> import torch, phalanx as px
    >>> net = torch.nn.Linear(4, 2)
    >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=px.Downpour())
    >>> opt.zero_grad(); model(torch.randn(8, 4)).sum().backward(); opt.step()
    >>> isinstance(px.strategy_of(opt), PSStrategy)
    True
    >>> px.strategy_of(opt).finish()
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import nn

from .. import check
from ..group import group
from ..group.env import WorkerEnv
from ..strategies.accounting import Accounting
from ..strategies.base import StepState, Strategy
from .client import ParamTable
from .elastic import FollowsElasticGroup
from .link import Link, connect
from .placement import policy as placement_policy
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


__all__ = ["PSStrategy"]
