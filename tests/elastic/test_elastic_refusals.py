"""What phalanx.elastic refuses before training, in one line (the layers below it know nothing of regroups)."""
from __future__ import annotations

import pytest
import torch

import phalanx as px
from phalanx.elastic.state import refuse_unreshardable
from phalanx.wrap import _STRATEGY


def _sharded(strategy: px.Strategy) -> torch.optim.Optimizer:
    # what px.wrap leaves on a sharded model's optimizer on 2+ workers: the rule, and the layout it runs on
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    strategy.sharded_by = px.FullyShard(group_size=2)
    setattr(opt, _STRATEGY, strategy)
    return opt


def test_a_sharded_rule_whose_state_no_regroup_reshards_is_refused_and_the_others_are_not():
    with pytest.raises(px.ConfigError, match=r"FullyShard\(group_size=2\) with DiLoCo.*under `phalanx run "
                                             r"--elastic`; expected px.AllReduce\(\) \(HSDP\), or a periodic rule"):
        refuse_unreshardable(_sharded(px.DiLoCo(every=2, compression=px.PowerSGD(rank=1))))  # its residuals
    # issue 39 item 4: an eager stand-in is one replica group's, which no regroup lays out by rows
    with pytest.raises(px.ConfigError, match=r"StreamingDiLoCo.*mixing='eager'.* under `phalanx run --elastic`; "
                                             r"expected StreamingDiLoCo with a numeric mixing and no moments="):
        refuse_unreshardable(_sharded(px.StreamingDiLoCo(every=2, fragments=1, mixing="eager")))
    for rule in (px.AllReduce(), px.LocalSGD(every=2), px.DiLoCo(every=2), px.EASGD(every=2),
                 px.StreamingDiLoCo(every=2, fragments=2, overlap=1), px.DiLoCo(every=2, compression=px.SparseLoCo())):
        refuse_unreshardable(_sharded(rule))
    refuse_unreshardable(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))  # not sharded
