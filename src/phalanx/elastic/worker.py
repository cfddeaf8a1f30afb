"""The worker's side of an elastic job: its id, the launcher's store, a heartbeat.

``phalanx run --elastic`` gives each worker a stable id (``PHALANX_ELASTIC_ID``) on
top of the standard variables; ranks change with every generation, ids never do.
A daemon thread bumps ``elastic/hb/<id>`` in the launcher's store; a stopped or
hung process stops bumping and the launcher kills it. If the store itself goes
away (the launcher's host is lost) the worker says so in one line and exits: no
one is left to coordinate a recovery.

Example:
    >>> ElasticWorker.from_environ({}) is None
    True
"""
from __future__ import annotations

import json
import os
import sys
import threading
from datetime import timedelta
from typing import Mapping

import torch.distributed as dist

from .. import group
from .membership import Membership, QuorumError, key
from .rebuild import destroy, rebuild

HEARTBEAT_EVERY_S = 0.5


class ElasticWorker:
    def __init__(self, me: str, addr: str, port: int, timeout_s: float) -> None:
        self.me, self.addr, self.port, self.timeout_s = me, addr, port, timeout_s
        self.store = self._connect()
        members = json.loads(self.store.get(key("gen", 0, "members")))
        self.membership = Membership(self.store, me, members)
        self.config = self.membership.config()
        self._stop = threading.Event()
        threading.Thread(target=self._beat, name="phalanx-heartbeat", daemon=True).start()

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "ElasticWorker | None":
        env = os.environ if env is None else env
        if "PHALANX_ELASTIC_ID" not in env:
            return None
        return cls(env["PHALANX_ELASTIC_ID"], env["MASTER_ADDR"], int(env["MASTER_PORT"]), group.timeout_s())

    def _connect(self) -> dist.TCPStore:
        return dist.TCPStore(self.addr, self.port, is_master=False, timeout=timedelta(seconds=self.timeout_s),
                             wait_for_workers=False)

    def _beat(self) -> None:
        store, misses = self._connect(), 0  # its own connection: the main thread may be blocked in the store
        while True:  # the first beat at once: the launcher only watches workers it has heard from
            try:
                store.add(key("hb", self.me), 1)
                misses = 0
            except Exception:  # noqa: BLE001 - any failure to reach the store counts as a miss
                misses += 1
                if misses >= 3 and not self._stop.is_set():
                    print(f"phalanx: elastic: worker {self.me} lost the rendezvous host {self.addr}:{self.port} "
                          "(the `phalanx run --elastic` launcher); stopping. Commits were in memory only: "
                          "resume from your last disk checkpoint (px.save_checkpoint), if any.",
                          file=sys.stderr, flush=True)
                    os._exit(1)
            if self._stop.wait(HEARTBEAT_EVERY_S):
                return

    def regroup(self, commits: list[int], *, backend: str) -> dict:
        """Leave the broken group, agree on the next generation, and join it; returns the plan."""
        destroy()  # first: peers blocked on our sockets fail now instead of at their timeout
        before = list(self.membership.members)
        plan = self.membership.next_generation(commits, timeout_s=self.config["heartbeat_s"] + 10.0)
        members = plan["members"]
        if len(members) < self.config["min_workers"]:
            raise QuorumError(f"{len(members)} worker(s) left, below --min-workers {self.config['min_workers']}")
        rebuild(self.store, plan["generation"], members.index(self.me), len(members), timeout_s=self.timeout_s,
                backend=backend)
        plan["left"] = [m for m in before if m not in members]
        plan["joined"] = [m for m in members if m not in before]
        return plan

    def finished(self) -> None:
        """Training is over on this worker: late joiners may leave."""
        try:
            self.store.set(key("finished", self.me), "1")
            self.store.set(key("done"), "1")
        except Exception:  # noqa: BLE001 - the launcher may already be gone at exit
            pass
