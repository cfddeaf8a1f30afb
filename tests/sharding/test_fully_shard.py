"""FSDP2's basics through px.FullyShard (issue 40), each bit-equal to torch's own ``fully_shard`` program.

One start of 4 gloo workers runs three cases, each as torch's FSDP2 program and through px.wrap on the same
seeds and batches (tests/workers/fully_shard.py): a model built on the meta device, initialised after sharding
(item 1); bf16 parameters with fp32 reduction (item 2); units by class and by function, one per block (item 3);
one group is plain FSDP on a 1-D mesh while HSDP keeps its 2-D one (item 4). Losses and final weights must be
equal bit for bit. Then the refusals, one line each, and a group of one, against plain torch.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import phalanx as px
from phalanx.errors import ConfigError
from support.procs import shared_run
from workers.fully_shard import Block, Transformer

runs = shared_run("workers.fully_shard:oracles", world_size=4, timeout=300, cases=["meta", "mixed", "hsdp"])


def _same(runs: list, case: str) -> None:
    for out in runs:
        ours, theirs = out[case]["phalanx"], out[case]["torch"]
        assert ours["losses"] == theirs["losses"]  # bit-equal, every step, every rank
        assert torch.equal(ours["full"], theirs["full"])
        assert ours["units"] == theirs["units"]


@pytest.mark.multiproc
def test_a_meta_model_is_sharded_then_initialised_as_torchs_program(runs):
    _same(runs, "meta")
    _same(runs, "hsdp")
    # ranks seeded apart (hsdp): rank 0's state initialises every replica, so shard s agrees across groups
    assert torch.equal(runs[0]["hsdp"]["phalanx"]["first"], runs[2]["hsdp"]["phalanx"]["first"])
    assert torch.equal(runs[1]["hsdp"]["phalanx"]["first"], runs[3]["hsdp"]["phalanx"]["first"])


@pytest.mark.multiproc
def test_bf16_parameters_with_fp32_reduction_equal_torchs_mp_policy(runs):
    _same(runs, "mixed")
    for out in runs:
        assert out["mixed"]["phalanx"]["compute_dtype"] == "torch.bfloat16"  # the gathered weights of a block
        assert out["mixed"]["phalanx"]["grad_dtype"] == "torch.float32"  # the sharded gradient, as the optimizer's
        assert out["meta"]["phalanx"]["compute_dtype"] == "torch.float32"


@pytest.mark.multiproc
def test_units_by_class_and_by_function_are_torchs_units(runs):
    for case in ("meta", "mixed"):  # a class, then a function
        for out in runs:
            assert out[case]["phalanx"]["units"] == ["", "layers.0", "layers.1", "layers.2"]
    _same(runs, "mixed")


@pytest.mark.multiproc
def test_one_group_is_plain_fsdp_and_hsdp_keeps_its_2d_mesh(runs):
    for out in runs:
        assert out["meta"]["phalanx"]["placements"] == ["(Shard(dim=0),)"]  # the FSDP2 example's own assertion
        assert out["meta"]["phalanx"]["mesh_dims"] == [1]
        assert out["hsdp"]["phalanx"]["placements"] == ["(Replicate(), Shard(dim=0))"]
        assert out["hsdp"]["phalanx"]["mesh_dims"] == [2]


# -- a group of one, and the refusals (no processes) ----------------------------------------------------------------
def _meta(make=Transformer) -> nn.Module:
    with torch.device("meta"):
        return make()


def test_a_meta_model_in_a_group_of_one_is_torchs_to_empty_then_reset_parameters():
    torch.manual_seed(3)
    ref = _meta()
    ref.to_empty(device="cpu")
    ref.reset_parameters()
    torch.manual_seed(3)
    model = _meta()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.wrap(model, opt, shard=px.FullyShard(group_size=1))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    assert opt.param_groups[0]["params"] == list(model.parameters())  # the same objects: the optimizer steps them


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def test_a_meta_module_without_an_initialiser_is_refused_in_one_line():
    model = _meta(lambda: nn.Sequential(nn.Linear(4, 4), Scale()))
    with pytest.raises(ConfigError) as e:
        px.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), shard=px.FullyShard(group_size=1))
    assert "module '1' (Scale) holds gain and has no reset_parameters()" in str(e.value)
    assert "Add reset_parameters() to Scale" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="on the meta device without shard="):
        model = _meta()
        px.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    half = nn.Sequential(_meta(lambda: nn.Linear(2, 2)), nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="partly on the meta device"):
        px.wrap(half, torch.optim.SGD(half.parameters(), lr=0.1), shard=px.FullyShard(group_size=1))


class Partial(Transformer):
    def reset_parameters(self) -> None:  # as pytorch/examples' FSDP2 Transformer: the blocks are forgotten
        for m in (self.emb, self.norm, self.head):
            m.reset_parameters()


def test_an_initialisation_that_leaves_a_tensor_unset_is_refused_naming_it():
    model = _meta(Partial)
    with pytest.raises(ConfigError) as e:
        px.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), shard=px.FullyShard(group_size=1))
    assert "whose Partial.reset_parameters() left 'layers.0.norm.weight' unset" in str(e.value)


@pytest.mark.parametrize("policy, given", [
    (MixedPrecisionPolicy(reduce_dtype=torch.int8), "reduce_dtype=torch.int8"),
    (MixedPrecisionPolicy(param_dtype=torch.float8_e4m3fn), "param_dtype=torch.float8_e4m3fn"),
    ("bf16", "mp_policy='bf16'"),
])
def test_a_dtype_the_workers_cannot_reduce_in_is_refused_before_training(policy, given):
    with pytest.raises(ConfigError) as e:
        px.FullyShard(group_size=2, mp_policy=policy)
    assert given in str(e.value) and "\n" not in str(e.value)


def test_a_unit_class_that_matches_no_module_is_refused_naming_it():
    model = Transformer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="no submodule of the Transformer is a Conv2d; expected classes of its "
                                          "submodules \\(it has Block, "):
        px.wrap(model, opt, shard=px.FullyShard(group_size=1, units=(Block, nn.Conv2d)))
    with pytest.raises(ConfigError, match="picked no submodule"):
        px.wrap(model, opt, shard=px.FullyShard(group_size=1, units=lambda m: False))
    with pytest.raises(ConfigError, match="not both"):
        px.FullyShard(group_size=1, units=Block, min_params=10)
    with pytest.raises(ConfigError, match="a module class"):
        px.FullyShard(group_size=1, units="Block")
    tied = Transformer()
    tied.head.weight = tied.emb.weight  # a GPT's tied embedding: the head cannot be a unit of its own
    with pytest.raises(ConfigError, match="picking 'head' \\(Linear\\), whose parameters a module outside it"):
        px.wrap(tied, torch.optim.SGD(tied.parameters(), lr=0.1), shard=px.FullyShard(group_size=1, units=nn.Linear))


def test_mixed_precision_in_a_group_of_one_says_that_nothing_is_cast():
    net = nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="leaves the model as it is"):
        model, _ = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), shard=px.FullyShard(
            group_size=1, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)))
    assert model.weight.dtype == torch.float32
