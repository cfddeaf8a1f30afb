"""A standby store for an elastic job: the job's store is no longer a single point of failure.

``phalanx join --standby-store ADDR[:PORT] ...`` hosts a second TCPStore on its own host,
copies the job's config into it (the nonce and the check of the job's secret: admission
there is guarded by the same secret) and publishes its address in the job's store
(``elastic/standby``), where every worker reads it (at start, and from its heartbeat
thread until it is there). While the primary answers, the standby launcher mirrors the
little it must know from it: the newest generation, its members, and the ids the primary
launcher started (``elastic/launched``).

When the primary stops answering (its host is lost: its launcher is gone, and every worker
it started ends with it, :mod:`phalanx.group.orphan`), the standby launcher *takes over*:
it marks those workers dead in its own store, announces the newest generation it saw, and
writes ``elastic/failover``. The surviving workers, whose own store calls failed at the same
moment, move to it (:meth:`phalanx.elastic.worker.ElasticWorker.fail_over`) and regroup there
as after any loss: the next generation, rolled back to the newest commit every survivor
holds; nothing a worker holds is lost, since the standby needs none of it. From then on the
standby launcher does the watcher's duties for the job (dead marks, hung workers killed,
members of other hosts declared dead when their heartbeat stops), and the store stays up
until the last member has finished. If the job was started with ``phalanx run --replace``
(the config it copied says so), it also replaces the workers *of its own host* it sees lost
after the take-over, as the primary's launcher did for its own: a new joiner on this host,
admitted at the survivors' next commit (not one whose script failed on its own, and no more
after 3 in a row that died before joining). The workers lost with the primary's host are not
replaced: that host is gone, and the job goes on with fewer (``phalanx join`` adds workers). A lost host comes back with
``phalanx join --rdzv-endpoint ADDR:PORT`` (this store), with the job's secret; with
``--standby-store`` too, it is the job's next standby (this store, the job's now, has no
``elastic/standby`` yet; the launcher that took over publishes ``elastic/launched`` here, and the
workers read the standby again on the store they failed over to): losing this host as well is
then one more failover, not the job's end.

Why a standby launched beside the workers and not an election among the survivors: the
workers of the standby's host are watched by the process that hosts it, so its dead marks
are a watcher's (seen to exit), and the address to fail over to is known before anything
is lost (no second agreement is needed while the first one is gone). What this does not
decide: a *partition* between the two hosts, both alive, looks to the standby like a lost
primary, and the two halves could each go on (the primary's half with its own workers).

Example:
    >>> parse_standby("10.0.0.2:29600"), parse_standby("10.0.0.2")
    (('10.0.0.2', 29600), ('10.0.0.2', 0))
"""
from __future__ import annotations

import json
import sys

from ..elastic.membership import key
from ..elastic.watch import mark_dead
from ..elastic.worker import FAILOVER, STANDBY
from ..errors import ConfigError, PhalanxError, usage
from .elastic import listening_store

LAUNCHED = key("launched")


def parse_standby(text: str) -> tuple[str, int]:
    """``--standby-store ADDR[:PORT]``: the address this host's standby store listens on (port 0: a free one).

    Example:
        >>> parse_standby("[::1]:0")
        ('::1', 0)
    """
    host, sep, port = text.rpartition(":")
    if not sep or "]" in port:
        host, port = text, "0"
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(usage(f"--standby-store {text}", "ADDR[:PORT], an address of this host every worker "
                                "reaches", "Pass e.g. --standby-store 10.0.0.2:29600 (port 0 or none: a free one)."))
    return host, int(port)


class Standby:
    """The standby store this launcher hosts, and what it knows of the primary's job.

    Example (a job's store and a standby on loopback)::

        standby = Standby("127.0.0.1", 0, primary)   # copies the config, publishes its address
        standby.mirror(primary)                        # while the primary answers
        store = standby.take_over(local={"j1-0"})      # once it does not: the job goes on here
    """

    def __init__(self, host: str, port: int, primary) -> None:  # primary: the job's dist.Store
        self.store = listening_store(host, port)
        self.host, self.port = host, self.store.port
        self.address = f"{host}:{self.port}"
        self.generation, self.members, self.launched = 0, [], []
        self.done = False  # training finished: the primary closing its store then is the job's end, not a loss
        config = primary.get(key("config"))
        self.store.set(key("config"), config)  # its nonce and check: the same secret admits
        self.replace = bool(json.loads(config).get("replace"))  # `phalanx run --replace`: kept once it took over
        if primary.compare_set(STANDBY, "", self.address).decode() != self.address:
            taken = primary.get(STANDBY).decode()
            self.close()
            raise PhalanxError(f"the job already has a standby store, at {taken}; start this `phalanx join` without "
                               "--standby-store (one standby per job)")
        self.mirror(primary)

    def mirror(self, primary) -> None:
        """Read what a take-over needs from the primary: the newest generation, its members, who its launcher
        started. Raises torch's ``DistError`` when the primary does not answer."""
        generation = int(primary.get(key("gen"))) if primary.check([key("gen")]) else 0
        self.members = json.loads(primary.get(key("gen", generation, "members")))
        self.generation = generation
        self.done = primary.check([key("done")])
        if primary.check([LAUNCHED]):
            self.launched = json.loads(primary.get(LAUNCHED))

    def take_over(self, local: set[str], lost: str) -> object:
        """The primary at ``lost`` is gone: mark its launcher's workers dead here, announce the newest generation,
        say ``failover``; returns this store, the job's from now on. ``local``: the workers this launcher runs."""
        store = self.store
        store.compare_set(key("gen", self.generation, "members"), "", json.dumps(self.members))
        if not store.check([key("gen")]):
            store.set(key("gen"), str(self.generation))
        gone = [w for w in self.launched if w not in local]
        for wid in gone:  # they end with their launcher (group.orphan): known dead, not partitioned
            mark_dead(store, wid, f"was lost with the job's store host {lost}")
        store.set(FAILOVER, "1")
        print(f"phalanx: elastic: the job's store at {lost} is lost (its launcher's host is gone, and with it "
              f"worker{'s' * (len(gone) != 1)} {', '.join(gone) or '-'}); the standby store at {self.address} takes "
              f"over: the other workers regroup here. Add workers with `phalanx join --rdzv-endpoint {self.address}`",
              file=sys.stderr, flush=True)
        return store

    def close(self) -> None:
        """Let go of the store: it stops listening once every handle on it (a take-over's clients too) is gone."""
        vars(self).pop("store", None)  # (twice: nothing more to let go of)
