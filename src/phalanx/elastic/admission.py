"""Admission: how a joiner or a spare gets a place in an elastic job, and how members decide to give it one.

A joiner proves it holds the job's secret (an HMAC of the launcher's nonce), lists itself in
``elastic/joiners`` and waits; members, at a commit point or a regroup, check each listed joiner's
proof once, pick who enters by :func:`admissible` (the one rule), offer the places, and wait
(bounded, consulting the dead marks) for every offered joiner to enter; a joiner that never comes
voids that generation and the next goes without it.

:class:`Admission` is the half of :class:`~phalanx.elastic.worker.ElasticWorker` that does this (a
mixin: its attributes are the worker's: ``self.store``, ``self.membership``, ``self.secret``, ...),
as :class:`~phalanx.elastic.recovery.Recovery` is beside ``px.elastic.State``.

Example:
    >>> admissible(["0", "2"], ["s0"], spares={"s0"}, workers=3, max_workers=3)
    ['s0']
"""
from __future__ import annotations

import json
import sys
import time

import torch.distributed as dist

from ..errors import PhalanxError, WorkerLostError
from ..group import leaving
from . import secret as job_secret
from .membership import joiner_ids, key
from .rebuild import destroy, rebuild


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
    returns normally: the worker finished, nothing failed (``phalanx.launch.raybackend.training_function``).

    Example:
        >>> EndedBeforeAdmitted().code
        0
    """

    def __init__(self) -> None:
        super().__init__(0)


class Admission:
    """Admission for :class:`~phalanx.elastic.worker.ElasticWorker` (a mixin: its attributes are the worker's)."""

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
