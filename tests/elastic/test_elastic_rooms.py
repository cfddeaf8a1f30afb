"""Elastic in three rooms: its control flow is public types, and it asks the clock and the sampler, never writes them.

In-process and fast: the multi-process behaviour is the oracle suites' (tests/elastic/*); these pin the contracts
that the split into ``elastic/state.py``, ``recovery.py`` and ``run.py`` put in place.
"""
from __future__ import annotations

import ast
import os
import types

import pytest

import phalanx as px
from phalanx.data.sampler import ShardSampler
from phalanx.elastic.run import _caught
from phalanx.step.clock import StepClock

SRC = os.path.dirname(px.__file__)
DOCS = os.path.join(os.path.dirname(os.path.dirname(SRC)), "docs", "elastic.md")


@pytest.mark.parametrize("change", [px.elastic.JoinersAdmitted(["j1"]), px.elastic.WorkersLeaving(["w2"])])
def test_a_membership_change_is_a_public_documented_base_exception_a_users_handler_cannot_swallow(change):
    assert isinstance(change, px.elastic.MembershipChange) and not isinstance(change, Exception)
    with pytest.raises(px.elastic.MembershipChange):
        try:
            raise change
        except Exception:  # what a user's loop may wrap its step in
            pass
    assert f"px.elastic.{type(change).__name__}" in open(DOCS).read()


def test_the_reentry_loop_takes_each_change_as_its_own():
    state = types.SimpleNamespace(_pending=None)
    assert _caught(state, px.elastic.JoinersAdmitted(["j1"])) and state._pending == ("joiners", ["j1"])
    assert _caught(state, px.elastic.WorkersLeaving(["w2"])) and state._pending[0] == "failure"
    assert "w2" in state._pending[1]


def test_the_clock_restores_a_step_and_the_sampler_is_reassigned_the_rest_of_its_epoch():
    clock = StepClock()
    clock.pending = True  # a backward ended, its step not closed: a rollback drops it
    clock.restore(7)
    assert (clock.step, clock.pending) == (7, False)
    sampler = ShardSampler(8, 2, rank=1, world_size=2, shuffle=False, seed=0, drop_last=True)
    sampler.samples = 4  # one global batch of 4 trained by two workers
    sampler.reassign(0, 1)  # the survivor alone: the rest of the epoch, whole
    assert list(sampler) == [[4, 5], [6, 7]]


def _writes(tree: ast.AST, owners: set[str], fields: set[str]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and el.attr in fields and isinstance(el.value, ast.Name) and \
                        el.value.id in owners:
                    found.append(f"{el.value.id}.{el.attr} (line {el.lineno})")
    return found


def test_elastic_never_writes_the_clocks_or_the_samplers_fields():
    writes = []
    for folder, _, files in os.walk(os.path.join(SRC, "elastic")):
        for f in files:
            if f.endswith(".py"):
                tree = ast.parse(open(os.path.join(folder, f)).read())
                writes += [f"{f}: {w}" for w in _writes(tree, {"clock", "sampler"},
                                                         {"step", "pending", "rank", "world_size", "global_size"})]
    assert writes == []


def test_regroup_has_one_meaning_a_rules_reaction_with_no_arguments():
    # forming the next group is ElasticWorker.rebuild(commits, backend=...); a rule's reaction is regroup()
    odd = []
    for folder, _, files in os.walk(SRC):
        for f in files:
            if f.endswith(".py"):
                for node in ast.walk(ast.parse(open(os.path.join(folder, f)).read())):
                    if isinstance(node, ast.FunctionDef) and node.name == "regroup" and (
                            [a.arg for a in node.args.args] != ["self"] or node.args.kwonlyargs):
                        odd.append(f"{os.path.relpath(os.path.join(folder, f), SRC)}:{node.lineno}")
    assert odd == []


def test_every_regroup_is_a_rules_reaction_to_a_rebuilt_group():
    # OverlappedMean's "forget this pass" (after every pass, elastic or not) was a second meaning of the name
    from phalanx.strategies.base import Strategy
    from phalanx.strategies.overlap import OverlappedMean
    assert not hasattr(OverlappedMean, "regroup") and callable(OverlappedMean.forget_pass)
    owners = []
    for folder, _, files in os.walk(SRC):
        for f in files:
            if f.endswith(".py"):
                for node in ast.walk(ast.parse(open(os.path.join(folder, f)).read())):
                    if isinstance(node, ast.ClassDef) and any(isinstance(b, ast.FunctionDef) and b.name == "regroup"
                                                              for b in node.body):
                        owners.append(node.name)
    classes = {c.__name__: c for c in _subclasses(Strategy)}
    mixins = {"Regroupable", "FollowsElasticGroup"}  # the protocol itself, and the PS rules' shared half
    assert [o for o in owners if o not in classes and o not in mixins] == [], owners
    assert len(owners) == 8, owners  # nine before, OverlappedMean's included


def _subclasses(cls: type) -> list[type]:
    return [cls, *[s for sub in cls.__subclasses__() for s in _subclasses(sub)]]


def test_allreduce_picks_one_of_four_named_averagers_from_explicit_facts():
    from phalanx.strategies.allreduce import averager
    plain = dict(sharded=False, compressed=False, quantised=False, world_size=4, rebuilt=False, wrapper=True)
    assert averager(**plain) == "ddp"
    assert averager(**{**plain, "sharded": True, "rebuilt": True}) == "sharded"
    assert averager(**{**plain, "world_size": 1}) == "after_backward"
    assert averager(**{**plain, "compressed": True, "rebuilt": True}) == "after_backward"
    assert averager(**{**plain, "world_size": 1, "rebuilt": True}) == "overlapped"  # a joiner attaches alone
    assert averager(**{**plain, "compressed": True, "quantised": True}) == "overlapped"
    assert averager(**{**plain, "wrapper": False}) == "overlapped"


def test_the_core_reads_its_own_records_that_elastic_fills_not_the_membership_mode():
    import torch

    from phalanx.step.preempt import HANDED_OVER, of
    from phalanx.strategies.allreduce import REBUILT
    g = px.init()
    assert g.elastic is False and REBUILT.of(g).value is None and HANDED_OVER.of(g).value is None
    net = torch.nn.Linear(2, 1)
    _, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert px.strategy_of(opt)._overlap is None  # a group of one nobody rebuilds: plain PyTorch
    REBUILT.of(g).value = HANDED_OVER.of(g).value = "a test"
    try:
        net = torch.nn.Linear(2, 1)
        _, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
        assert px.strategy_of(opt)._overlap is not None  # its hooks follow the group wherever it goes
        preemption = of(g)
        preemption.signal = 15  # as the handler records a SIGTERM
        assert preemption.at_boundary(1) is False  # whoever took it over takes the worker out, not the boundary
    finally:
        REBUILT.of(g).value = HANDED_OVER.of(g).value = None
        of(g).signal = None


class _Members:
    """What a commit point asks of the job's store, answered by the test: who leaves and who joins at each step."""

    def __init__(self, *, leavers: list[str] = (), joiners: list[str] = ()) -> None:
        self.me, self.membership, self.asked = "w0", self, []
        self._leavers, self._joiners = list(leavers), list(joiners)

    def beat(self) -> None:
        pass

    def pending_joiners(self) -> list[str]:
        return self._joiners

    def leavers(self, step: int) -> list[str]:
        self.asked.append(step)
        return self._leavers

    def admit(self, step: int, proposal) -> list[str]:
        return proposal()

    def leave(self, step: int) -> None:
        self.left = step  # the real one writes the goodbye and ends the process (PREEMPTED_EXIT)


@pytest.mark.parametrize("members, change", [(_Members(joiners=["j1"]), px.elastic.JoinersAdmitted),
                                             (_Members(leavers=["w2"]), px.elastic.WorkersLeaving)])
def test_with_a_plain_loader_a_change_comes_out_of_state_commit_never_out_of_opt_step(members, change):
    import torch

    net = torch.nn.Linear(2, 1)
    net, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    state = px.elastic.State(net, opt, commit_every=2)  # no loader of px.shard's: the loop's commit() decides
    state.worker = members  # the store's decisions, as a member of an elastic job would read them
    state._hook_commit_point()
    state._attempting = True  # as @px.elastic.run sets it while the training function runs
    try:
        for _ in range(4):
            opt.zero_grad()
            net(torch.ones(1, 2)).sum().backward()
            opt.step()  # the due commits are taken here (steps 2 and 4), and nothing is decided or raised
        assert sorted(state.commits) == [2, 4] and members.asked == []
        with pytest.raises(change):
            state.commit()  # the call the loop wrote
        assert members.asked == [4]
        state._attempting = False
        state.commit()  # outside @px.elastic.run it only commits: nothing would handle a change there
    finally:
        for handle in state._handles:
            handle.remove()


def test_a_loop_that_never_calls_commit_lets_a_leaver_end_its_process_at_a_commit_not_raise_from_opt_step():
    """A plain loop with no state.commit() has no point to raise a change at: a worker asked to leave ends its own
    process at the first commit every member holds (the others meet it gone and redo nothing); no exception."""
    import torch

    net = torch.nn.Linear(2, 1)
    net, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    state = px.elastic.State(net, opt, commit_every=2)
    members = _Members(leavers=["w0"])  # this worker (w0) was sent SIGTERM
    state.worker = members
    state._hook_commit_point()
    state._attempting, state._leaving = True, True
    try:
        for _ in range(3):
            opt.zero_grad()
            net(torch.ones(1, 2)).sum().backward()
            opt.step()  # raises nothing; at the commit of step 2 the leaver ends its process
        assert getattr(members, "left", None) == 2 and sorted(state.commits) == [2]
    finally:
        for handle in state._handles:
            handle.remove()
