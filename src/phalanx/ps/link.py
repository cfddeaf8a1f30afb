"""How a worker reaches its servers: the job's server processes, or colocated ones.

* ``PHALANX_PS_ADDRS`` is set (``phalanx run --servers S``): connect to those servers.
* It is not set: colocated mode. Every worker starts one shard server in a thread of its
  own process, and the workers swap addresses once through the group's rendezvous
  store. As in BytePS, each worker then holds 1/N of the model, and the bytes moved
  equal a ring all-reduce's. A colocated server lives as long as its worker. At
  :meth:`Link.release` each worker says it is done and keeps serving until every
  worker has said so (bounded by the PS timeout), so no one loses a shard mid-step.

The rendezvous store is used at attach and at release only, never per step.
"""
from __future__ import annotations

import atexit
import itertools
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

from ..group import group
from ..strategies.allreduce import rebuilt
from ..errors import ConfigError, usage
from .client import Client, PSError
from .config import HOST, TOKEN, PSConfig, is_loopback
from .server import Server

_generation = itertools.count()  # every worker attaches its PS strategies in the same order


@dataclass
class Link:
    client: Client
    hosted: Server | None = None  # this worker's colocated server
    store: Any = None  # kept alive until release: rank 0's process hosts the rendezvous store
    key: str = ""
    released: bool = False
    _barriers: int = 0

    def barrier(self, what: str, *, timeout: float | None = None, strict: bool = True) -> bool:
        """Wait until every worker of the group reached this point, through the rendezvous store.

        No collective: a worker that is gone only costs the others ``timeout`` seconds.
        Returns False (after a warning) if some worker never came and ``strict`` is False;
        raises :class:`PSError` if ``strict``. A group of one returns at once.
        """
        store = group.store()
        if store is None or group.world_size() == 1:
            return True
        self._barriers += 1
        prefix, rank, world = f"{self.key}/barrier/{self._barriers}", group.rank(), group.world_size()
        limit = self.client.timeout if timeout is None else timeout
        store.set(f"{prefix}/{rank}", "1")
        missing = []
        try:
            store.wait([f"{prefix}/{r}" for r in range(world)], timedelta(seconds=limit))
            return True
        except Exception:  # torch raises its store's own timeout error
            missing = [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
        why = (f"{what}: worker(s) {missing} did not arrive within {limit:g} s (crashed, or much slower); "
               "raise PHALANX_PS_TIMEOUT if they are only slow")
        if strict:
            raise PSError(why)
        warnings.warn(why, stacklevel=3)
        return False

    def release(self) -> None:
        """Close the client; a colocated server first waits (bounded) until every worker is done."""
        if self.released:
            return
        self.released = True
        self.client.close()
        if self.hosted is None:
            return
        if self.store is not None:
            rank, world = group.rank(), group.world_size()
            try:
                self.store.set(f"{self.key}/done/{rank}", "1")
                self.store.wait([f"{self.key}/done/{r}" for r in range(world)],
                                timedelta(seconds=self.client.timeout))
            except Exception:  # a peer is gone or the store is; nobody is left to serve
                pass
        self.hosted.stop(save=False)


def connect(servers: str | Sequence[str] | None = None, *, timeout: float | None = None,
            key: str | None = None) -> Link:
    """A :class:`Link` to ``servers``: addresses, "colocated", or None (the environment decides).

    ``key`` names the colocated servers' address exchange in the group's store (default:
    one per attach, counted); under ``--elastic`` it names the group's generation instead.
    """
    cfg = PSConfig.from_environ()
    timeout = cfg.timeout_s if timeout is None else timeout
    if servers is None:
        servers = list(cfg.addrs) or "colocated"
    if isinstance(servers, str) and servers != "colocated":
        servers = [a for a in servers.split(",") if a]
    if servers == "colocated":
        return _colocated(cfg, timeout, key)
    if not isinstance(servers, (list, tuple)) or not servers:
        raise ConfigError(usage(f"servers={servers!r}", "None, 'colocated' or a list of tcp://HOST:PORT",
                                "Leave it unset to use PHALANX_PS_ADDRS or colocated servers."))
    return Link(Client(servers, token=cfg.token, timeout=timeout), key=f"ps/job/{next(_generation)}")


def _colocated(cfg: PSConfig, timeout: float, key: str | None = None) -> Link:
    # An elastic joiner's local world size says nothing about where the others run (a joiner is alone here).
    g = group.current()
    if is_loopback(cfg.host) and g.env.local_world_size < g.world_size and not rebuilt(g):
        raise ConfigError(usage(f"colocated parameter servers on {cfg.host} in a multi-host run",
                                "an address the other hosts can reach",
                                f"Set {HOST}=<this host's IP> and {TOKEN} on every worker, or start servers "
                                "with `python -m phalanx.ps serve` and set PHALANX_PS_ADDRS."))
    server = Server(cfg.host, token=cfg.token, index=group.rank(), round_timeout=timeout).start()
    store, key = group.store(), key or f"ps/colocated/{next(_generation)}"
    if store is None:  # a group of one
        addrs = [server.address]
    else:
        store.set(f"{key}/addr/{group.rank()}", server.address)
        store.wait([f"{key}/addr/{r}" for r in range(group.world_size())], timedelta(seconds=timeout))
        addrs = [store.get(f"{key}/addr/{r}").decode() for r in range(group.world_size())]
    link = Link(Client(addrs, token=cfg.token, timeout=timeout), hosted=server, store=store, key=key)
    atexit.register(link.release)  # if the script never calls strategy.finish()
    return link


def follow_group(link: Link, servers: str | Sequence[str] | None, timeout: float | None) -> Link:
    """Under ``--elastic``, after the worker group changed: the link the new group uses.

    Separate servers (``--servers``) outlive every worker: the same link. Colocated ones
    die with their worker, so the new group's workers stop their old servers, start fresh
    ones and swap addresses again; placement then spreads the shards over the servers of
    the workers that are left (and of the joiners). A caller re-registers its shards.
    """
    if link.hosted is None:
        return link
    link.client.close()
    link.hosted.stop(save=False)
    link.released = True
    return connect(servers, timeout=timeout, key=f"ps/colocated/elastic/{group.current().generation}")
