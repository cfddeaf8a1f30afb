"""The worker's side of an elastic job: its id, the launcher's store, a heartbeat.

``phalanx run --elastic`` gives each worker a stable id (``PHALANX_ELASTIC_ID``, read
into the group's environment once) on top of the standard variables; ranks change with
every generation, ids never do. A daemon thread bumps ``elastic/hb/<id>`` in the
launcher's store; a stopped or hung process stops bumping and the launcher kills it. If the store itself goes
away (the launcher's host is lost) and the job has a standby store (``phalanx join --standby-store``, whose
address every worker reads from the job's store: :data:`STANDBY`), the worker fails over to it
(:meth:`ElasticWorker.fail_over`) and regroups there with the other survivors; without one it says so in one line
and exits: no one is left to coordinate a recovery.

Why this is a second heartbeat, beside the group's (:attr:`phalanx.group.group.Group.heartbeat`), in two lines:
the group's beats a *rank* in one generation's store and is restarted at every rebuild; the launcher watches an
*id* that must beat without a gap through every rebuild and while parked, and a lost launcher store ends the worker.
In detail:

* **different readers and keys.** The group's beats under the *rank*, in the *generation's*
  key space (peers diagnose a lost rank there; a dead generation's keys are never read
  again). The launcher watches the *id*, in its own store, across every generation.
* **the group's is replaced at every rebuild**: ``Group._attach_store`` stops it and starts
  one on the next generation's store under the new rank, after ``init_process_group``. The
  id must beat through the whole regroup (the quorum wait can last ``--heartbeat-timeout``
  + 10 s) and while a joiner is parked, before it has a group store at all.
* **a lost store means different things.** The group's thread ends quietly (nobody can
  tell anything then); losing the launcher's store must end the worker (above).
* **tried and reverted.** Commit e350a2c bumped the id from the group's heartbeat
  (``Group.beat_also``); its restart at each rebuild left gaps, and under load the
  launcher killed healthy workers for "no heartbeat for 2.1 s" (reverted in 94ebf93).
  One thread could carry both only if the group's heartbeat were re-pointed in place at a
  rebuild instead of stopped and restarted; that is not built.

Example:
    >>> ElasticWorker.of(group.current()) is None   # not under `phalanx run --elastic`
    True
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, NoReturn

import torch.distributed as dist

from ..group import group, leaving, orphan
from ..group.records import Record, Slot
from ..errors import PhalanxError
from ..step import telemetry
from ..step.preempt import PREEMPTED_EXIT
from . import secret as job_secret
from .membership import Membership, QuorumError, key
from .admission import Admission, EndedBeforeAdmitted
from .rebuild import destroy, rebuild

HEARTBEAT_EVERY_S = 0.5
STANDBY = key("standby")  # in the primary store: "HOST:PORT" of the job's standby store, if it has one
FAILOVER = key("failover")  # in the standby store: its launcher found the primary lost; the workers regroup there


def place(g: group.Group) -> None:
    """``px.init()`` under ``--elastic``: start this worker's side of the job; a joiner waits here for its place.

    A joiner or a spare asks to join and blocks until the members offer it a place (at a commit
    point) or admit it (a spare, at a regroup); the group then holds its rank, world size and
    generation (:meth:`~phalanx.group.group.Group.place`), as ``RANK``/``WORLD_SIZE`` would under
    torchrun. The members train on while its script starts up; it enters (takes rank 0's state)
    at their first commit point after its script starts training (``px.elastic.run``,
    ``state.epochs``). Training that ended before it got a place ends the process here, with
    status 0 (:class:`EndedBeforeAdmitted`): nothing is left
    for it to do.
    """
    worker = ElasticWorker.of(g)
    if worker is None or not worker.joining or g.entering:
        return
    worker.beat()  # parked here, possibly for the whole job (a spare): the launcher watches it from now on
    plan = worker.wait_for_place(offers=True)
    if plan is None:
        print(f"phalanx: elastic: worker {worker.me}: training ended before it was admitted; nothing to do",
              file=sys.stderr, flush=True)
        raise EndedBeforeAdmitted
    g.place(plan["members"].index(worker.me), len(plan["members"]), plan["generation"])
    # The standard variables too, as torchrun gives its workers: scripts (nanoGPT's) decide from RANK whether
    # they run distributed and derive settings from WORLD_SIZE. Like every worker's, they tell the place at start.
    os.environ.update(RANK=str(g.rank), WORLD_SIZE=str(g.world_size), LOCAL_RANK=str(g.local_rank))


# This worker's side of the elastic job, kept per group (a record elastic owns, not a slot on the Group).
WORKER: "Record[Slot[ElasticWorker]]" = Record("elastic worker", Slot)


def read_standby(store: dist.Store) -> tuple[str, int] | None:
    """The job's standby store, as its launcher published it in ``store`` (None: the job has none, or not yet).

    Example:
        >>> import torch.distributed as dist
        >>> read_standby(dist.HashStore()) is None
        True
    """
    if not store.check([STANDBY]):
        return None
    host, _, port = store.get(STANDBY).decode().rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


class ElasticWorker(Admission):
    """This worker's side of an elastic job: membership, admission, and its id kept alive in the launcher's store.

    One per group (:meth:`of`), made by ``px.init()``; its id, the store's address, the
    timeout and the job's secret come from the group's environment, read once there.
    """

    def __init__(self, g: group.Group) -> None:
        env = g.env
        self.group, self.me = g, env.elastic_id or ""
        self.addr, self.port, self.timeout_s = env.master_addr, env.master_port, env.timeout_s
        self.joining = env.elastic_join  # started by `phalanx join` or `--replace`: enters at the next commit point
        self.secret = env.elastic_secret  # the job's: a joiner proves it holds it, a member checks joiners' proofs
        self._proven: set[str] = set()  # joiners whose proof this member has checked
        # The joiners list as last read, and the ids in it that proved the secret: a list read again unchanged
        # costs nothing more, and an id that failed its proof is never checked again (its proof was written
        # before it was listed, so it cannot come later), so entries nobody admits cost one look each, not
        # one per commit.
        self._listed: tuple[bytes, list[str]] = (b"[]", [])
        self._refused: set[str] = set()
        self._warned = False
        self._offered: dict[str, list[float]] = {}  # a joiner offered a place: [beats, when they last moved, since]
        self._asked = False  # a joiner: it asked to join (once; it waits in the joiners list until admitted)
        self.store = self._connect()
        self.primary = f"{self.addr}:{self.port}"  # the store it started on (after a failover: the one lost), for lines
        self.standby = read_standby(self.store)  # (host, port) of the job's standby store; read again by _beat
        self._failing_over = threading.Lock()  # the heartbeat thread and the main thread may both find the loss
        members = [] if self.joining else json.loads(self.store.get(key("gen", 0, "members")))
        self.membership = Membership(self.store, self.me, members)
        self.config = self.membership.config()
        if self.joining and not self._holds_secret():
            raise PhalanxError(f"worker {self.me} does not hold the secret of the elastic job at {self.addr}:"
                               f"{self.port}; set {job_secret.ENV} (or `phalanx join --secret-file`) to the job's "
                               "secret")
        self._closed = False
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None
        # Closed before the interpreter exits, on every path: a heartbeat still inside a store call while the
        # interpreter is torn down aborts the process ("terminate called without an active exception").
        atexit.register(self.close)
        self.placed: dict | None = None  # a joiner: the generation that admitted it, found by px.init()

    @classmethod
    def of(cls, g: group.Group) -> "ElasticWorker | None":
        """This worker's side of the elastic job of group ``g`` (made once, kept on the group); None outside one."""
        if not g.elastic:
            return None
        slot = WORKER.of(g)
        if slot.value is None:
            slot.value = cls(g)
        return slot.value

    def beat(self) -> None:
        """Start bumping ``elastic/hb/<id>`` in the launcher's store (a daemon thread); idempotent.

        The launcher watches ids, not ranks, and only those it has heard from: a member starts
        when its ``px.elastic.State`` is built (its setup is not watched for hangs), a joiner as
        it starts waiting in ``px.init()``. Its own thread and store connection, apart from the
        group's heartbeat, which pauses while the group is rebuilt: the launcher must not take a
        rebuild for a hang. A store that stops answering ends the worker.
        """
        if self._beating is None:
            self._beating = threading.Thread(target=self._beat, name="phalanx-elastic-heartbeat", daemon=True)
            self._beating.start()

    def _beat(self) -> None:
        store, misses = self._connect(), 0  # its own connection: the main thread may be blocked in the store
        on = (self.addr, self.port)
        while True:  # the first beat at once: the launcher only watches workers it has heard from
            try:
                if (self.addr, self.port) != on:  # the main thread failed over: beat on the standby store now
                    store, on = self._connect(), (self.addr, self.port)
                store.add(key("hb", self.me), 1)
                if self.standby is None:  # a standby may come after this worker started, or after a failover (a
                    self.standby = read_standby(store)  # returning host's `phalanx join --standby-store`)
                misses = 0
            except Exception:  # noqa: BLE001 - any failure to reach the store counts as a miss
                misses += 1
                if misses >= 3 and not self._stop.is_set() and not self.fail_over(on):
                    self.lost_host()
            if self._stop.wait(HEARTBEAT_EVERY_S):
                return

    def fail_over(self, lost: tuple[str, int] | None = None) -> bool:
        """The job's store is lost: move to its standby store, if it has one that took over; False if not.

        Idempotent, from any thread: the first caller connects to the standby store (bounded by the
        heartbeat timeout), waits there (bounded the same way) for its launcher's word that the primary is
        lost (``failover``: it marked the workers of the lost host dead there), and then swaps this worker's
        store and membership onto it; the next regroup (:meth:`rebuild`) happens there, from the generation
        and the commits this worker holds. A standby that never answers, or never takes over (its launcher
        still reaches the primary: the loss is this worker's own), leaves the loss as it was: False. So does
        the end of this worker's own launcher: the worker ends then (:mod:`phalanx.group.orphan`), it never
        trains on unwatched on the standby.

        Once moved, the store it moved to is the job's: this worker forgets the standby it used and reads the
        job's next one there (a host that comes back with ``phalanx join --standby-store``), so a second loss
        fails over again.
        """
        launcher = self.group.env.launcher_pid
        if launcher is not None and orphan.launcher_gone(launcher):
            return False  # our own launcher is gone with the store: this worker ends (group.orphan), never fails over
        # ``lost``: the address of the store the caller found gone (default: the one in use now). Taken before
        # the caller asked, not here: the other thread may have failed over in between, and this store's
        # standby is then None (read again on the new store), which would read as "nothing to fail over to".
        lost = (self.addr, self.port) if lost is None else lost
        with self._failing_over:
            if (self.addr, self.port) != lost:
                return self.host_alive()  # failed over already, by the other thread
            if self.standby is None:
                return False
            host, port = self.standby
            bound = float(self.config["heartbeat_s"])
            try:
                store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=bound),
                                      wait_for_workers=False)
                deadline = time.monotonic() + bound
                while not store.check([FAILOVER]):
                    if time.monotonic() > deadline or store.check([key("dead", self.me)]):
                        return False  # no take-over within the bound, or the standby counts this worker lost
                    time.sleep(0.05)  # sleep: the standby launcher's word comes with no notification; bounded
                if store.check([key("dead", self.me)]):
                    return False  # the standby took over counting this worker lost (its launcher's): it ends
            except Exception:  # noqa: BLE001 - the standby is gone too, or unreachable: nothing to fail over to
                return False
            self.membership.adopt(store)
            self.primary = f"{lost[0]}:{lost[1]}"  # the store lost, for the lines that name it
            self.store, self.addr, self.port, self.standby = store, host, port, None  # _beat reads the next standby
            print(f"phalanx: elastic: worker {self.me} lost the job's store at {self.primary}; its standby store at "
                  f"{host}:{port} took over; regrouping there", file=sys.stderr, flush=True)
            return True

    def _connect(self) -> dist.TCPStore:
        return dist.TCPStore(self.addr, self.port, is_master=False, timeout=timedelta(seconds=self.timeout_s),
                             wait_for_workers=False)

    def close(self, wait_s: float = 5.0) -> None:
        """Say we are leaving (``finished/<id>``), then stop the heartbeat thread and wait for it (at most ``wait_s``).

        The watcher must not take the silence of a process that is exiting for a hang and kill it.
        """
        if not self._closed:
            self._closed = True
            try:
                self.store.set(key("finished", self.me), "1")
            except Exception:  # noqa: BLE001 - the launcher may be gone; then nobody is watching
                pass
        self._stop.set()
        if self._beating is not None and self._beating.is_alive() and self._beating is not threading.current_thread():
            self._beating.join(wait_s)

    def lost_host(self) -> None:
        """The launcher's store is gone: say so once (from whichever thread notices first) and end."""
        # No exit handlers: they would wait on the store that is gone. One line per worker, also when its
        # launcher's end (group.orphan) is noticed at the same moment.
        how = "and no standby store took over" if self.standby is not None else \
            "and the job has no standby store (`phalanx join --standby-store`)"
        leaving.end_now(f"phalanx: elastic: worker {self.me} lost the rendezvous host {self.addr}:{self.port} "
                        f"(the `phalanx run --elastic` launcher), {how}; stopping. Commits were in memory only: "
                        "resume from your last disk checkpoint (px.save_checkpoint), if any.")

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) of the job's store this worker uses now (its standby's, after a failover)."""
        return self.addr, self.port

    def host_alive(self) -> bool:
        """Does the job's store (the one this worker uses now) answer?"""
        try:
            self.store.check([key("config")])
            return True
        except Exception:  # noqa: BLE001 - any failure to reach it
            return False

    def rebuild(self, commits: list[int], *, backend: str) -> dict:
        """Leave the broken group, agree on the next generation, and join it; returns the plan.

        Forming the next group is ``rebuild``; ``Strategy.regroup()`` is a rule's reaction to it, afterwards.

        The quorum also admits waiting joiners (spares first fill the places of the lost):
        the caller sends them the state when ``plan["joined"]`` is not empty.
        """
        destroy()  # first: peers blocked on our sockets fail now instead of at their timeout
        before = list(self.membership.members)
        while True:
            plan = self.membership.next_generation(commits, timeout_s=self.config["heartbeat_s"] + 10.0,
                                                   joiners=lambda survivors: self.joiners_for(survivors,
                                                                                              regroup=True))
            # survivors hold a commit; the others (spares, joiners, joiners whose entry failed) enter
            survivors = [m for m in plan["members"]
                         if m in before and not self.membership.joining_again(plan["generation"], m)]
            if self._entered(plan["generation"], [m for m in plan["members"] if m not in survivors]):
                break
            # an admitted spare or joiner never came: that generation is void; the next one goes without it
            self.membership.members = before
        members = plan["members"]
        # spares and joiners never count toward the minimum
        if len(survivors) < self.config["min_workers"]:
            raise QuorumError(f"{len(survivors)} worker(s) left, below --min-workers {self.config['min_workers']}")
        rebuild(self.store, plan["generation"], members.index(self.me), len(members), timeout_s=self.timeout_s,
                backend=backend, lost=self.lost_among(members))
        plan["left"] = [m for m in before if m not in members]
        plan["joined"] = [m for m in members if m not in survivors]
        return plan

    def lost_among(self, members: list[str]) -> Callable[[], list[int]]:
        """The ranks of ``members`` marked dead now (``dead/<id>``): what forming their group stops waiting for."""
        return lambda: [r for r, m in enumerate(members) if m != self.me and self.membership.is_dead(m)]

    def leave(self, step: int) -> NoReturn:
        """Leave the group gracefully at the commit of ``step`` (this worker was preempted) and end the process.

        The goodbye is ``dead/<id>`` written by the worker itself: the survivors' quorum counts it
        gone at once instead of waiting for its process to be reaped. Its state is in the commit
        every survivor holds, so nothing is lost or redone; the process ends at once with status
        ``PREEMPTED_EXIT`` (no exit barrier: the others are not leaving).
        """
        print(f"phalanx: elastic: worker {self.me} leaves the group after step {step} (preempted; the others go "
              "on from this commit, nothing redone)", file=sys.stderr, flush=True)
        try:
            self.store.set(key("dead", self.me), "left")
        except Exception:  # noqa: BLE001 - the launcher is gone: nobody is left to tell
            pass
        self._stop.set()
        sys.stdout.flush()
        os._exit(PREEMPTED_EXIT)

    def finished(self) -> None:
        """Training is over on this worker: late joiners may leave; our heartbeat stops."""
        reporter = telemetry.of(self.group)  # `--status`: the page shows the last step (a Ray actor does not exit)
        if reporter is not None:
            try:
                reporter.send()
            except Exception:  # noqa: BLE001 - the page's store is the launcher's: it may be gone at exit
                pass
        try:
            self.store.set(key("finished", self.me), "1")
            self.store.set(key("done"), "1")
        except Exception:  # noqa: BLE001 - the launcher may already be gone at exit
            pass
        self.close()
