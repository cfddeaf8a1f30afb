"""Generations and quorum, kept in the launcher's store.

A generation is one worker group: an ordered list of worker ids whose position is
the rank. Generation 0 is the group the launcher started. After a failure every
survivor *arrives* at generation g+1 with the commits it holds; the first survivor
that sees the quorum complete writes the member list with a compare-and-set, so
every worker agrees on one list even if their views differed for a moment.

Quorum rules (after torchft's): wait until every member of the previous generation
has either arrived or been declared dead by a watcher, up to ``timeout_s``; then
proceed only with more than half of the previous members not declared dead, so that
two halves of a partitioned job can never both go on (split brain). A member declared
dead was seen to exit by the watcher on its host, or its heartbeat stopped reaching
the one store every member agrees through: it cannot be the other half of a split.

Keys (all under ``elastic/`` in the launcher's TCPStore):
    config                 {"min_workers", "max_workers", "heartbeat_s"} written by the launcher
    hb/<id>                a counter the worker's heartbeat thread bumps
    dead/<id>              set by the launcher when worker <id> exited or was killed
    gen                    the newest closed generation
    gen/<g>/members        JSON list of ids, rank order
    gen/<g>/arrive/<id>    JSON {"commits": [...]} of a survivor; {"commits": [], "joining": true} of a joiner
                           whose entry into g-1 failed and that waits to be admitted again
    gen/<g>/join/<id>      a joiner asking to enter generation g
    admit/<g>/<step>       JSON list of the joiners admitted at the commit of <step> in generation g
    finished/<id>          worker <id> finished training (its heartbeat may stop while it exits)
    leaving/<id>           worker <id> was sent SIGTERM/SIGUSR1 and asks to leave at the next commit
    leave/<g>/<step>       JSON list of the members leaving at the commit of <step> in generation g
    done                   set when training finished (late joiners leave)
    standby                "HOST:PORT" of the job's standby store (``phalanx join --standby-store``), in the primary
    launched               JSON list of the ids the primary launcher started (workers, spares, replacements)
    failover               in the standby store: its launcher found the primary lost and marked the workers of
                           ``launched`` dead there (they end with their launcher); the others regroup there

Example:
    >>> decide_members(["a", "b", "c"], arrived={"a", "c"}, dead={"b"}, joiners=[])
    ['a', 'c']
    >>> common_commit([[4, 2], [4, 2]]), common_commit([[6, 4], [4, 2]])
    (4, 4)
"""
from __future__ import annotations

import json
import time
from typing import Callable, Iterable, Sequence

import torch.distributed as dist

from ..errors import PhalanxError

PREFIX = "elastic"


class QuorumError(PhalanxError, RuntimeError):
    """The survivors cannot form a legal group (too few, or split brain)."""


def key(*parts: object) -> str:
    return "/".join([PREFIX, *map(str, parts)])


def decide_members(previous: Sequence[str], *, arrived: set[str], dead: set[str],
                   joiners: Sequence[str]) -> list[str]:
    """The next generation: surviving previous members in their old order, then joiners."""
    return [m for m in previous if m in arrived and m not in dead] + [j for j in joiners if j not in previous]


def joiner_ids(raw: bytes | str) -> list[str] | None:
    """The ids listed in the store's ``joiners`` key; None when it is not a JSON list (anyone can write the store).

    Entries that are not strings are left out: only ids that prove the job's secret are ever admitted.

    Example:
        >>> joiner_ids(b'["r1", 3, "j-0"]'), joiner_ids(b"{not json")
        (['r1', 'j-0'], None)
    """
    try:
        ids = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(ids, list):
        return None
    return [j for j in ids if isinstance(j, str)]


def common_commit(commit_lists: Iterable[Sequence[int]]) -> int | None:
    """The newest commit step that every survivor holds, or None."""
    sets = [set(c) for c in commit_lists]
    if not sets:
        return None
    common = set.intersection(*sets)
    return max(common) if common else None


class Membership:
    """One worker's view of the job's generations."""

    def __init__(self, store: dist.Store, me: str, members: list[str], generation: int = 0) -> None:
        self.store, self.me = store, me
        self.members, self.generation = members, generation

    # -- what the launcher wrote -------------------------------------------------------
    def config(self) -> dict:
        return json.loads(self.store.get(key("config")))

    def is_dead(self, worker: str) -> bool:
        return self.store.check([key("dead", worker)])

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    # -- one membership change ------------------------------------------------------------
    def next_generation(self, commits: Sequence[int], *, timeout_s: float, poll_s: float = 0.02,
                        joiners: Callable[[list[str]], list[str]] | None = None) -> dict:
        """Arrive at generation g+1, wait for the quorum, and return the agreed plan.

        The plan is ``{"generation", "members", "step"}``: the member list (rank order)
        and the commit step every member rolls back to. Raises :class:`QuorumError`
        when more than half of the previous members are missing. ``joiners(survivors)``
        says who enters with the survivors (spares, joiners); by default every waiting joiner.
        """
        g = self.generation + 1
        self.store.set(key("gen", g, "arrive", self.me), json.dumps({"commits": list(commits)}))
        deadline = time.monotonic() + timeout_s
        members_key = key("gen", g, "members")
        while True:
            if self.store.check([members_key]):
                break
            arrived = {m for m in self.members if self.store.check([key("gen", g, "arrive", m)])}
            # A joiner whose entry failed (the group did not form, or a peer died before it had the state)
            # answered that it waits to join again: not a survivor, and not counted by the guard.
            back = {m for m in arrived if self.joining_again(g, m)}
            dead = {m for m in self.members if m not in arrived and self.is_dead(m)}
            complete = len(arrived) + len(dead) == len(self.members)
            if complete or time.monotonic() > deadline:
                # Members a watcher saw exit are known gone, not partitioned: the guard counts the rest
                # (so losing every worker of one host of two still leaves a quorum).
                counted = len(self.members) - len(dead) - len(back)
                if 2 * len(arrived - back) <= counted:
                    raise QuorumError(
                        f"only {len(arrived - back)} of the {counted} workers of generation {g - 1} "
                        f"not known dead answered within {timeout_s:.0f}s; more than half are needed to go on "
                        "(split-brain guard)")
                survivors = decide_members(self.members, arrived=arrived - back, dead=dead, joiners=[])
                proposal = survivors + (joiners(survivors) if joiners is not None else self._joiners(g))
                self.store.compare_set(members_key, "", json.dumps(proposal))
                break
            time.sleep(poll_s)
        members = json.loads(self.store.get(members_key))
        if self.me not in members:
            raise QuorumError(f"worker {self.me} arrived after generation {g} closed without it")
        survivors = [m for m in members if m in self.members and not self.joining_again(g, m)]
        arrivals = [json.loads(self.store.get(key("gen", g, "arrive", m)))["commits"] for m in survivors]
        step = common_commit(arrivals)
        if step is None:
            raise QuorumError(f"the survivors hold no common commit (theirs: {arrivals})")
        self.store.set(key("gen"), str(g))
        self.members, self.generation = members, g
        return {"generation": g, "members": members, "step": step}

    def adopt(self, store: dist.Store) -> None:
        """Go on in ``store`` (the job's standby store, after the primary was lost): this worker's generation and
        its members are announced there (the first survivor's word stands), so the next regroup starts from them.

        The standby holds nothing the survivors need: they bring their generation, their members and their
        commits (torchft's lighthouse keeps only soft state for the same reason).
        """
        self.store = store
        if not self.members:
            return  # a joiner that was never admitted: nothing to announce
        store.compare_set(key("gen", self.generation, "members"), "", json.dumps(self.members))
        if not store.check([key("gen")]) or int(store.get(key("gen"))) < self.generation:
            store.set(key("gen"), str(self.generation))

    def joining_again(self, g: int, m: str) -> bool:
        """Did ``m`` arrive at generation ``g`` as a joiner whose entry into ``g - 1`` failed (no commit held)?"""
        k = key("gen", g, "arrive", m)
        return self.store.check([k]) and bool(json.loads(self.store.get(k)).get("joining"))

    def join_again(self, failed: int) -> None:
        """A joiner whose entry into generation ``failed`` failed: tell the members regrouping from it (who wait
        for every member of ``failed`` to arrive) that it holds no commit and waits to be admitted again."""
        self.store.set(key("gen", failed + 1, "arrive", self.me), json.dumps({"commits": [], "joining": True}))
        self.members, self.generation = [], failed

    def admit(self, step: int, proposal: Callable[[], list[str]]) -> list[str]:
        """Who joins at the commit of ``step``: the first member to get there decides for all.

        Every member proposes (``proposal()``: the joiners waiting now) and a compare-and-set
        keeps the first proposal, so all members read one decision and none waits for
        another's word: a member that dies inside the commit (rank 0 included) holds nobody up.
        """
        decision = key("admit", self.generation, step)
        if not self.store.check([decision]):
            self.store.compare_set(decision, "", json.dumps(proposal()))
        return json.loads(self.store.get(decision))

    def ask_to_leave(self) -> None:
        """This worker was told to stop (SIGTERM: its node is drained): it leaves at the next commit."""
        self.store.set(key("leaving", self.me), "1")

    def leavers(self, step: int) -> list[str]:
        """Who leaves at the commit of ``step``: the first member there decides for all (as :meth:`admit`)."""
        decision = key("leave", self.generation, step)
        if not self.store.check([decision]):
            asked = [m for m in self.members if self.store.check([key("leaving", m)])]
            self.store.compare_set(decision, "", json.dumps(asked))
        return json.loads(self.store.get(decision))

    def _joiners(self, g: int) -> list[str]:
        raw = self.store.get(key("joiners")) if self.store.check([key("joiners")]) else b"[]"
        return [j for j in joiner_ids(raw) or [] if not self.is_dead(j)]
