"""The worker's side of an elastic job: its id, the launcher's store, a heartbeat.

``phalanx run --elastic`` gives each worker a stable id (``PHALANX_ELASTIC_ID``, read
into the group's environment once) on top of the standard variables; ranks change with
every generation, ids never do. A daemon thread bumps ``elastic/hb/<id>`` in the
launcher's store; a stopped or hung process stops bumping and the launcher kills it. If the store itself goes
away (the launcher's host is lost) the worker says so in one line and exits: no
one is left to coordinate a recovery.

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

from ..group import group, leaving
from ..group.records import Record, Slot
from ..errors import PhalanxError, WorkerLostError
from ..step import telemetry
from ..step.preempt import PREEMPTED_EXIT
from . import secret as job_secret
from .membership import Membership, QuorumError, joiner_ids, key
from .rebuild import destroy, rebuild

HEARTBEAT_EVERY_S = 0.5


def admissible(members: list[str], waiting: list[str], *, spares: set[str], workers: int,
               max_workers: int) -> list[str]:
    """The one admission rule, at a regroup and at a commit point alike.

    Joiners (``phalanx join``, ``--replace``) grow the group up to ``max_workers``; spares
    only fill it back up to ``workers`` (the ``-n`` it started with): a spare replaces a
    lost worker, it never grows the job.

    Example:
        >>> admissible(["0", "2"], ["s0", "s1"], spares={"s0", "s1"}, workers=3, max_workers=5)
        ['s0']
        >>> admissible(["0", "1", "2"], ["s0", "j1"], spares={"s0"}, workers=3, max_workers=5)
        ['j1']
    """
    regular = [j for j in waiting if j not in spares]
    taken = regular[:max(0, max_workers - len(members))]
    room = min(workers, max_workers) - len(members) - len(taken)
    return taken + [s for s in waiting if s in spares][:max(0, room)]


class EndedBeforeAdmitted(SystemExit):
    """A joiner found training over before it was admitted: status 0 (a ``SystemExit``: no traceback).

    Under ``phalanx run`` the process ends with status 0. A launcher that runs the training
    function in a process that lives on (Ray Train's worker actors) catches this type and
    returns normally: the worker finished, nothing failed (``phalanx.launch.raytrain``).

    Example:
        >>> EndedBeforeAdmitted().code
        0
    """

    def __init__(self) -> None:
        super().__init__(0)


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


class ElasticWorker:
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
        while True:  # the first beat at once: the launcher only watches workers it has heard from
            try:
                store.add(key("hb", self.me), 1)
                misses = 0
            except Exception:  # noqa: BLE001 - any failure to reach the store counts as a miss
                misses += 1
                if misses >= 3 and not self._stop.is_set():
                    self.lost_host()
            if self._stop.wait(HEARTBEAT_EVERY_S):
                return

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
        leaving.end_now(f"phalanx: elastic: worker {self.me} lost the rendezvous host {self.addr}:{self.port} "
                        "(the `phalanx run --elastic` launcher); stopping. Commits were in memory only: "
                        "resume from your last disk checkpoint (px.save_checkpoint), if any.")

    def host_alive(self) -> bool:
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

    # -- joining ------------------------------------------------------------------------------
    def _holds_secret(self) -> bool:
        """Does our secret match the one the launcher published (as an HMAC of its nonce)?"""
        if self.secret is None or "check" not in self.config:
            return False
        return job_secret.matches(self.secret, self.config["nonce"], self.config["check"])

    def _ask_to_join(self) -> None:
        """Present our proof of the secret, then append ourselves to the joiners (compare-and-set: they race)."""
        self.store.set(key("proof", self.me), job_secret.proof(self.secret or "", self.config["nonce"], self.me))
        joiners_key = key("joiners")
        while True:
            old = self.store.get(joiners_key) if self.store.check([joiners_key]) else b""
            new = json.dumps(sorted(set(joiner_ids(old or b"[]") or []) | {self.me}))  # a bad value is replaced
            if self.store.compare_set(joiners_key, old, new).decode() == new:
                return

    def _proves(self, joiner: str) -> bool:
        """The first check of admission: did ``joiner`` prove it holds the job's secret? (constant-time compare)"""
        if joiner in self._proven:
            return True
        k = key("proof", joiner)
        if self.secret is None or "nonce" not in self.config or not self.store.check([k]):
            return False
        if job_secret.proves(self.secret, self.config["nonce"], joiner, self.store.get(k).decode()):
            self._proven.add(joiner)
            return True
        return False

    def joiners_for(self, members: list[str], *, regroup: bool = False) -> list[str]:
        """Who enters a group of ``members`` now: waiting joiners and spares, by :func:`admissible`.

        Only joiners that proved they hold the job's secret are considered at all, and only those
        *ready* enter: waiting at the start of training (``ready/<id>``, written by
        :meth:`wait_for_admission`), so that entering costs the members no wait for anyone's start-up.
        At a regroup the parked spares enter too (they take the places of the lost there). A joiner
        still starting (a ``--replace`` replacement, a ``phalanx join`` worker, a spare at a commit
        point) is offered a place instead (:meth:`_offer`): ``px.init()`` returns it, the joiner builds
        its model while the members train on, and it enters at the first commit point after it is ready.
        """
        waiting = [j for j in self._listed_joiners() if j not in members and not self.membership.is_dead(j)]
        spares = set(self.config.get("spares", []))
        ready = [j for j in waiting if (regroup and j in spares) or self.store.check([key("ready", j)])]
        rule = dict(spares=spares, workers=self.config.get("workers", self.config["max_workers"]),
                    max_workers=self.config["max_workers"])
        entering = admissible(members, ready, **rule)
        if not regroup:
            starting = self._not_stalled([j for j in waiting if j not in ready])
            self._offer(members + entering, admissible(members + entering, starting, **rule))
        return entering

    def _not_stalled(self, starting: list[str]) -> list[str]:
        """``starting`` without the joiners offered a place that went silent or did not start in time (dropped).

        Looked at from commit points, never waited for: an offered joiner whose heartbeat stands
        still for the heartbeat timeout (a stray name that proves the secret, a process that died),
        or that is not ready within the job's timeout after its offer (a script that never reaches
        training), is marked dead, never offered a place again, and the members never stopped for it.
        """
        now, heartbeat_s = time.monotonic(), float(self.config["heartbeat_s"])
        keep = []
        for j in starting:
            if not self.store.check([key("offer", j)]):
                keep.append(j)
                continue
            beats = int(self.store.add(key("hb", j), 0))
            seen = self._offered.setdefault(j, [beats, now, now])
            if beats != seen[0] and beats > 0:
                seen[0], seen[1] = beats, now
            if now - seen[1] <= heartbeat_s and now - seen[2] <= max(self.timeout_s, heartbeat_s):
                keep.append(j)
                continue
            mark = f"dropped by {self.me}"
            if self.store.compare_set(key("dead", j), "", mark).decode() == mark:  # one line, by one member
                print(f"phalanx: elastic: {j} was offered a place but never got ready to train (no heartbeat for "
                      f"{heartbeat_s:g}s, or not training {max(self.timeout_s, heartbeat_s):g}s after the offer); "
                      "dropped, the others go on without it", file=sys.stderr, flush=True)
        return keep

    def _offer(self, members: list[str], joiners: list[str]) -> None:
        """Offer each of ``joiners`` a place after ``members`` (``offer/<id>``, once): what its ``px.init()`` returns.

        The place (rank, world size, generation) is the one it gets if nothing changes before it is
        ready; the generation it enters decides in the end (:meth:`wait_for_admission`).
        """
        generation = self.membership.generation + (2 if len(members) > len(self.membership.members) else 1)
        place = json.dumps({"generation": generation, "members": members + joiners})
        for j in joiners:
            if not self.store.check([key("offer", j)]):
                self.store.compare_set(key("offer", j), "", place)

    def _listed_joiners(self) -> list[str]:
        """The listed joiners that proved the job's secret, in list order; what cannot be used is left out.

        The store is writable by whoever reaches it: a value that is not a JSON list of ids is
        ignored (one warning), and ids without a valid proof are checked once and dropped from
        the list (a compare-and-set: a joiner appending meanwhile wins), so they slow no later commit.
        """
        joiners_key = key("joiners")
        raw = self.store.get(joiners_key) if self.store.check([joiners_key]) else b"[]"
        if raw == self._listed[0]:
            return self._listed[1]
        ids = joiner_ids(raw)
        if ids is None and not self._warned:
            self._warned = True
            # One line for the job: whichever member reads the garbage first claims the warning (any member may
            # read it first, and the one that prunes it leaves nothing for the others to see).
            if self.store.compare_set(key("joiners-warned"), "", self.me) == self.me.encode():
                print(f"phalanx: elastic: ignoring the store's {joiners_key} ({raw[:60]!r}...: not a JSON list of "
                      "worker ids; something other than phalanx wrote it); joiners add themselves again",
                      file=sys.stderr, flush=True)
        listed = ids or []
        proven = [j for j in listed if j not in self._refused and self._proves(j)]
        self._refused.update(j for j in listed if j not in self._proven)
        if ids is None or len(proven) < len(ids):  # prune what no member will ever admit
            self.store.compare_set(joiners_key, raw, json.dumps(sorted(set(proven))))
        self._listed = (raw, proven)
        return proven

    def pending_joiners(self) -> list[str]:
        """Rank 0, at a commit point: joiners to admit now (up to --max-workers), in arrival order."""
        return self.joiners_for(self.membership.members)

    def _entered(self, generation: int, joiners: list[str], poll_s: float = 0.02) -> bool:
        """Members: did every joiner admitted to ``generation`` arrive? False (and they are marked dead) if not.

        Each admitted joiner claims ``gen/<g>/entered/<id>`` with a compare-and-set when it arrives
        (where its script starts training: it was placed in ``px.init()`` and has built its model
        since); a member that gave up on it claims the key for "out" instead. The key holds whichever
        came first, so every member and the joiner read the same verdict, and so the same answer in
        ``gen/<g>/go``. A joiner that never connects or stops beating (a stray name written into the
        store, a process that died or hung after asking) costs the members at most the heartbeat
        timeout, never the job; a live one that is still setting up gets the job's timeout
        (``px.init(timeout=...)``, ``PHALANX_TIMEOUT``) to reach training.
        """
        if not joiners:
            return True
        go = key("gen", generation, "go")
        heartbeat_s = float(self.config["heartbeat_s"])
        started = time.monotonic()
        seen = {j: (-1, started) for j in joiners}  # each joiner's heartbeat count and when it last changed
        pending = list(joiners)
        while pending:
            now = time.monotonic()
            for j in list(pending):
                verdict = key("gen", generation, "entered", j)
                if self.store.check([verdict]):
                    pending.remove(j)
                    continue
                beats = int(self.store.add(key("hb", j), 0))
                if beats != seen[j][0] and beats > 0:
                    seen[j] = (beats, now)
                silent = now - seen[j][1] > heartbeat_s
                if silent or now - started > max(self.timeout_s, heartbeat_s) or self.membership.is_dead(j):
                    self.store.compare_set(verdict, "", "out")
            if pending:
                time.sleep(poll_s)
        lost = [j for j in joiners if self.store.get(key("gen", generation, "entered", j)) != b"in"]
        for j in lost:
            self.store.set(key("dead", j), "1")  # never admitted again
        # the key's value, not ours, is the verdict: a joiner past its own bound may have answered "no" first
        if self.store.compare_set(go, "", "no" if lost else "yes") != b"yes" and not lost:
            lost = list(joiners)
            for j in lost:
                self.store.set(key("dead", j), "1")
        if lost and self.membership.rank == 0:
            print(f"phalanx: elastic: {', '.join(lost)} admitted to generation {generation} but never arrived "
                  f"(no heartbeat for {heartbeat_s:g}s, or not training {max(self.timeout_s, heartbeat_s):g}s after "
                  "its admission); dropped, the others go on without", file=sys.stderr, flush=True)
        return not lost

    def grow(self, joiners: list[str], *, backend: str) -> dict:
        """Members and joiners form the next generation; nobody rolls back.

        If an admitted joiner never arrives (see :meth:`_entered`) the members form the
        generation after it without the joiners instead, so every process agrees on the group.
        """
        g = self.membership.generation + 1
        before = list(self.membership.members)
        members = before + joiners
        # Every member writes the same list (no one waits for rank 0's word), and takes generation g before
        # the rebuild: if a member dies during it, the survivors regroup from g, joiners counted.
        self.store.compare_set(key("gen", g, "members"), "", json.dumps(members))
        self.store.set(key("gen"), str(g))
        if not self._entered(g, joiners):
            g, members, joiners = g + 1, before, []
            self.store.compare_set(key("gen", g, "members"), "", json.dumps(members))
            self.store.set(key("gen"), str(g))
        self.membership.members, self.membership.generation = members, g
        rebuild(self.store, g, members.index(self.me), len(members), timeout_s=self.timeout_s, backend=backend,
                lost=self.lost_among(members))
        return {"generation": g, "members": members, "left": [], "joined": joiners}

    def wait_for_place(self, after: int = -1, poll_s: float = 0.05, *, offers: bool = False) -> dict | None:
        """A joiner: ask to join (once), then block until a generation after ``after`` includes us.

        Returns the plan (generation, members) without entering it: :meth:`wait_for_admission`
        enters. None when training ended first. ``px.init()`` calls this with ``offers=True``: a place
        the members offered (``offer/<id>``, :meth:`_offer`) returns too, so a joiner's script reads
        the rank and world size it will train with, and starts up while the members train on.
        """
        try:
            return self._wait_for_place(after, poll_s, offers)
        except dist.DistError:  # the job's store closed under us: training ended, or its launcher is gone
            self._stop.set()  # our heartbeat thread must not say the same thing again, as a lost host
            print(f"phalanx: elastic: worker {self.me}: the job's store at {self.addr}:{self.port} closed before it "
                  "was admitted (training ended, or the job's launcher is gone); nothing to do", file=sys.stderr,
                  flush=True)
            raise EndedBeforeAdmitted from None

    def _wait_for_place(self, after: int, poll_s: float, offers: bool) -> dict | None:
        if not self._asked:
            self._ask_to_join()
            self._asked = True
        seen = after
        offer = key("offer", self.me)
        while True:
            if self.store.check([key("done")]):
                self.close()  # training ended before we got in: nothing of ours runs any more
                return None
            if self.store.check([key("dead", self.me)]):
                raise PhalanxError(f"worker {self.me} was offered a place in the elastic job but did not reach "
                                   f"training within the job's timeout ({self.timeout_s:g}s); the others went on "
                                   "without it. Start training sooner after px.init(), or raise the timeout "
                                   "(px.init(timeout=...) or PHALANX_TIMEOUT)")
            if offers and self.store.check([offer]):
                place = json.loads(self.store.get(offer))
                return {"generation": place["generation"], "members": place["members"], "left": [],
                        "joined": [self.me], "offered": True}
            g = int(self.store.get(key("gen"))) if self.store.check([key("gen")]) else -1
            if g > seen:
                seen = g
                members = json.loads(self.store.get(key("gen", g, "members")))
                if self.me in members:
                    self.placed = {"generation": g, "members": members, "left": [], "joined": [self.me]}
                    return self.placed
            time.sleep(poll_s)

    def wait_for_admission(self) -> dict | None:
        """A joiner: take the place :meth:`wait_for_place` found (or wait for one) and enter it; None if training ended.

        Entering is the compare-and-set the members wait for (at most the heartbeat timeout after
        they admitted us), then the rebuild of the group with us in it. A generation that formed
        without us after all (another joiner never came) sends us back to wait for the next one.
        """
        self.store.set(key("ready", self.me), "1")  # started up: the members admit us at their next commit point
        plan = self.placed if self.placed is not None and not self.placed.get("offered") else self.wait_for_place()
        while plan is not None:
            g, members = plan["generation"], plan["members"]
            if self._enter(g):
                # a member from here on: if the group does not form, the members regroup from generation g
                self.membership.members, self.membership.generation = members, g
                try:
                    rebuild(self.store, g, members.index(self.me), len(members), timeout_s=self.timeout_s,
                            backend="gloo", lost=self.lost_among(members))
                except WorkerLostError:
                    self.join_again(g)  # a peer was lost while the group formed: wait to be admitted again
                else:
                    self.joining, self.placed = False, None
                    return plan
            plan = self.placed = self.wait_for_place(after=g)
        return None

    def join_again(self, failed: int) -> None:
        """A joiner whose entry into generation ``failed`` failed (the group did not form, or a peer died before it
        had rank 0's state): leave what formed, tell the regrouping members not to count on it, wait again.

        It has no commit to roll back to, so it is no survivor: the members admit it again as a joiner
        (it is still in ``joiners``), at their regroup or at a later commit point.
        """
        destroy()
        self.membership.join_again(failed)
        self.group.entering, self.joining, self.placed = True, True, None
        print(f"phalanx: elastic: worker {self.me}: a peer was lost while it entered generation {failed}; it waits "
              "to be admitted again", file=sys.stderr, flush=True)

    def _enter(self, generation: int) -> bool:
        """Claim our place in ``generation``; True once the members agree it forms with us (``gen/<g>/go``)."""
        verdict = key("gen", generation, "entered", self.me)
        if self.store.compare_set(verdict, "", "in").decode() != "in":
            raise PhalanxError(f"worker {self.me} was admitted to generation {generation} but did not reach "
                               f"training within the job's timeout ({self.timeout_s:g}s) after px.init() returned; "
                               "the others went on without it. Start training sooner after px.init(), or raise "
                               "the timeout (px.init(timeout=...) or PHALANX_TIMEOUT)")
        return self._verdict(generation) == "yes"

    def _verdict(self, generation: int, poll_s: float = 0.02) -> str:
        """A joiner that claimed its place in ``generation``: the members' answer in ``gen/<g>/go``, "yes" or "no".

        The members decide within the job's timeout (:meth:`_entered`), but only while one of them lives: the
        wait watches the dead marks of those who decide (the generation's members that did not claim a place as
        joiners). If they are all dead, nobody holds the training state to hand over: this worker ends with one
        line. Past the members' own bound (with a heartbeat timeout to spare) it answers "no" itself, with the
        same compare-and-set, so whatever is in the key is what everyone acts on.
        """
        go = key("gen", generation, "go")
        members = json.loads(self.store.get(key("gen", generation, "members")))
        heartbeat_s = float(self.config["heartbeat_s"])
        deadline = time.monotonic() + max(self.timeout_s, heartbeat_s) + 2 * heartbeat_s
        while not self.store.check([go]):
            deciders = [m for m in members if m != self.me and not self.store.check([key("gen", generation,
                                                                                      "entered", m)])]
            if deciders and all(self.membership.is_dead(m) for m in deciders) and not self.store.check([go]):
                self.close()
                leaving.end_now(f"phalanx: elastic: worker {self.me}: every member of the job ({', '.join(deciders)})"
                                f" was lost while it entered generation {generation}; nobody is left to hand it the "
                                "training state, so it stops. Commits were in memory only: resume from your last "
                                "disk checkpoint (px.save_checkpoint), if any.")
            if time.monotonic() > deadline:
                self.store.compare_set(go, "", "no")
                break
            time.sleep(poll_s)
        return self.store.get(go).decode()

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
