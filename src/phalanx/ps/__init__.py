"""Parameter servers: sharded servers, placement, and the strategies that use them.

Asynchronous training that never waits for the slowest worker::

    import phalanx as px
    px.init()
    model, opt = px.wrap(model, opt, strategy=px.Downpour(push_every=1, pull_every=4))
    ...                                   # your loop, unchanged
    px.strategy_of(opt).finish()          # load the servers' parameters into the model

Launch with ``phalanx run -n 4 --servers 2 train.py``, or with no ``--servers`` for
colocated servers (one shard per worker). See ``docs/parameter-server.md``.
"""
from __future__ import annotations

from .async_easgd import AsyncEASGD
from .client import Client, ParamTable, PSError, ServerUnreachable
from .downpour import Downpour
from .launcher import ServerGroup, ServerStartError, start_servers
from .optim import SGD, Adagrad
from .placement import GreedyBytes, RoundRobin, imbalance, server_bytes
from .report import LoadReport, load_report, save_shards
from .server import Server
from .shards import Policy, RejectError
from .strategy import PSStrategy
from .sync_server import ParameterServer, SyncParameterServer
from .wire import Header, WireError

__all__ = [
    "Adagrad", "AsyncEASGD", "Client", "Downpour", "GreedyBytes", "Header", "LoadReport", "PSError", "PSStrategy",
    "ParamTable", "ParameterServer", "Policy", "RejectError", "RoundRobin", "SGD", "Server", "ServerGroup",
    "ServerStartError", "ServerUnreachable", "SyncParameterServer", "WireError", "imbalance", "load_report",
    "save_shards", "server_bytes", "start_servers",
]
