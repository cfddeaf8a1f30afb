"""px.Strategy stays a protocol of at most 8 members: what a new rule's author reads (issue 37 item 2).

Members are counted over everything px.Strategy carries: non-dunder methods and class-level
attributes of every class in its MRO that lives in phalanx. Features ask more of a rule through
Protocols of their own, never by adding here. Run with ``-s`` to see the figure.
"""
from __future__ import annotations

import pytest

import phalanx as px
from phalanx.checkpoint.training_state import ReplicaState
from phalanx.data.balance import UnevenBatches
from phalanx.elastic.rule import CommitPoint, Regroupable
from phalanx.sharding.layout import OnShards
from phalanx.step.protocols import ReplicasAgree, WeighsGradients
from phalanx.strategies import PRESETS, REGISTRY, Accounted, by_name
from phalanx.strategies.base import Joinable, ServerBacked

LIMIT = 8


def members(cls: type) -> list[str]:
    """Non-dunder names defined by ``cls`` and its bases inside phalanx (methods, properties, class attributes)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] == "phalanx":
            names |= {n for n in vars(klass) if not (n.startswith("__") and n.endswith("__"))}
    return sorted(names)


def test_strategy_has_at_most_eight_members():
    got = members(px.Strategy)
    print(f"\npx.Strategy members: {len(got)} {got}")
    assert len(got) <= LIMIT, got


def test_each_capability_is_a_protocol_the_built_in_rules_implement_where_they_take_part():
    bare = px.Strategy()
    protocols = [WeighsGradients, ReplicasAgree, ReplicaState, Joinable, Accounted, UnevenBatches, OnShards,
                 ServerBacked, Regroupable, CommitPoint]
    assert not any(isinstance(bare, p) for p in protocols)  # a bare rule takes part in nothing
    allreduce, local, easgd = px.AllReduce(), px.LocalSGD(every=4), px.EASGD()
    assert all(isinstance(allreduce, p) for p in (WeighsGradients, ReplicaState, Accounted, UnevenBatches,
                                                  Regroupable))
    assert not isinstance(allreduce, (ReplicasAgree, OnShards, ServerBacked, CommitPoint, Joinable))
    assert all(isinstance(local, p) for p in (ReplicasAgree, OnShards, ReplicaState, UnevenBatches))
    assert isinstance(easgd, Regroupable) and not isinstance(local, Regroupable)


def test_the_names_are_a_read_only_view_of_the_presets_and_the_named_classes():
    assert "downpour" in REGISTRY and "no-such-rule" not in REGISTRY  # phalanx.ps's rules, found by class
    assert set(PRESETS) <= set(REGISTRY) and len(REGISTRY) == len(list(REGISTRY))
    with pytest.raises(TypeError):
        REGISTRY["x"] = px.AllReduce  # type: ignore[index]
    with pytest.raises(TypeError):
        PRESETS["x"] = px.AllReduce  # type: ignore[index]

    class Named(px.AllReduce):
        name = "named-for-a-test"

    assert isinstance(by_name("named_for_a_test"), Named) and REGISTRY["named-for-a-test"] is Named
