"""Sharded state (issue 21 item 1): FSDP within a replica group, a phalanx strategy across groups.

Against one-process oracles on real gloo processes: px.AllReduce on a sharded model (FSDP, S = 2;
HSDP, 2 x 2) equals one process on the global batch with AdamW, clipping, a scheduler and a short
last global batch; LocalSGD, DiLoCo (also with FP16), EASGD and StreamingDiLoCo across 2 groups of 2 shards equal the
same rule on 2 unsharded replicas, with half the bytes per rank; px.save from a sharded model loads
into the plain one. And the refusals, one line each.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import phalanx as px
from phalanx.errors import ConfigError
from phalanx.group.group import Group
from phalanx.group.env import WorkerEnv
from support.procs import run_workers

N = 13  # samples: the last global batch of 8 is short (5), so parts differ in size
RULES = ["local-sgd", "diloco", "diloco-fp16", "easgd", "streaming"]


@pytest.mark.multiproc
def test_fsdp_equals_one_process_on_the_global_batch(tmp_path):
    runs = run_workers("workers.sharding:gradient_oracle", world_size=2, timeout=180, n=N, batch=4, group_size=2,
                       path=str(tmp_path / "model.pt"), accumulate=True, tied=True).results
    for out in runs:
        assert out["sharded"]
        assert out["diff"] < 1e-5
        assert out["tied_diff"] < 1e-5  # tied weights in two submodules: kept in one FSDP unit
        assert out["accumulated_diff"] < 1e-5  # px.no_sync micro-batches: FSDP reduce-scatters once, at the end
    assert runs[0]["saved_diff"] < 1e-5  # px.save wrote plain whole weights that the unwrapped model takes


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory) -> list[dict]:
    return run_workers("workers.sharding:hsdp_and_groups", world_size=4, timeout=300, n=N, batch=2,
                       path=str(tmp_path_factory.mktemp("hsdp") / "model.pt"), rules=[*RULES, "diloco-sparseloco"],
                       steps=4).results


@pytest.mark.multiproc
def test_hsdp_equals_one_process_on_the_global_batch(two_by_two):
    for out in two_by_two:
        assert out["sharded"]
        assert out["diff"] < 1e-5
    assert two_by_two[0]["saved_diff"] < 1e-5


@pytest.mark.multiproc
@pytest.mark.parametrize("rule", RULES)
def test_rules_across_groups_equal_unsharded_replicas_with_half_the_bytes(two_by_two, rule):
    for out in two_by_two:
        assert out[rule]["diff"] < 1e-5
        # each rank sends its shard (half the parameters) plus the same few scalars (the replica's share)
        assert 0 < out[rule]["bytes"] <= out[rule]["ref_bytes"] / 2 + 8


@pytest.mark.multiproc
def test_an_all_gathered_compressor_on_shards_gathers_over_the_replicate_group(two_by_two):
    # DiLoCo + px.SparseLoCo on shards all-gathered over the default group (4 ranks) into a list sized for the
    # replicate group (2): gloo refused it, and phalanx took that for a lost peer. Its top-k chunks are cut from
    # each rank's rows, so it is not the unsharded rule's result: it trains, and sends less than a replica does
    for out in two_by_two:
        assert out["diloco-sparseloco"]["diff"] < 0.5
        assert 0 < out["diloco-sparseloco"]["bytes"] < out["diloco-sparseloco"]["ref_bytes"]


@pytest.mark.multiproc
def test_streaming_diloco_on_shards_equals_streaming_diloco_on_unsharded_replicas(two_by_two):
    # issue 39 item 4: each rank exchanges its rows of each fragment over the replicate dimension, the fragments
    # cut by whole tensors' sizes (the same on every rank), the overlap and the mix as on unsharded replicas
    for out in two_by_two:
        assert out["streaming"]["diff"] <= 1e-6


def _group(world: int = 1, elastic: bool = False) -> Group:
    env = dataclasses.replace(WorkerEnv.from_environ(), world_size=world, elastic_id="job" if elastic else None)
    return Group(env, torch.device("cpu"))


@pytest.mark.parametrize("strategy, why", [
    (lambda: px.Downpour(), "parameter server"),
    (lambda: px.LocalSGD(every=4, warmup_steps=10), "LocalSGD without warm-up"),
    (lambda: px.AllReduce(compression=px.FP16()), "without compression"),
    (lambda: px.StreamingDiLoCo(every=4, fragments=1, quantize=4), "without quantize= or SparseLoCo"),
    (lambda: px.StreamingDiLoCo(every=4, fragments=2, cut="values"), "StreamingDiLoCo with whole-tensor fragments"),
])
def test_strategies_that_cannot_run_on_shards_are_refused(strategy, why):
    with pytest.raises(ConfigError, match=why):
        px.FullyShard(group_size=1).check(_group(), strategy())


def test_a_shard_size_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ConfigError, match=r"FullyShard\(group_size=3\) with 4 workers; expected a group size "
                                          r"that divides the world size \(1, 2, 4\)"):
        px.FullyShard(group_size=3).check(_group(4), px.AllReduce())
    # the layout knows nothing of elastic membership: phalanx.elastic refuses what a regroup cannot re-shard
    px.FullyShard(group_size=1).check(_group(elastic=True), px.LocalSGD(every=2))
    joiner = _group(3, elastic=True)
    joiner.entering = True  # a joiner enters the layout the job has now, whatever its world size
    px.FullyShard(group_size=2).check(joiner, px.AllReduce())
    with pytest.raises(ConfigError, match="integer >= 1"):
        px.FullyShard(group_size=0)
    net = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="px.FullyShard object"):
        px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), shard=2)


def test_a_group_of_one_with_group_size_one_is_plain_pytorch():
    net = torch.nn.Linear(2, 2)
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), shard=px.FullyShard(group_size=1))
    assert model is net and isinstance(net.weight, torch.nn.Parameter) and type(net.weight.data) is torch.Tensor
