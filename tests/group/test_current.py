"""`px.current_group()` before `px.init()`: a group of one for a plain script, a clear refusal in a launched worker."""
from __future__ import annotations

import pytest
import torch.nn.functional as F
import torch

import phalanx as px
from phalanx.group import group


@pytest.fixture
def before_init(monkeypatch):
    monkeypatch.setattr(group, "_group", None)  # this process as it is before its script calls px.init()
    for var in ("WORLD_SIZE", "RANK", "PHALANX_ELASTIC_ID"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_a_plain_script_is_a_group_of_one(before_init):
    g = px.current_group()
    assert (g.rank, g.world_size, g.elastic) == (0, 1, False)


def test_an_elastic_worker_that_skipped_px_init_is_refused_before_it_trains_alone(before_init):
    # `phalanx run --elastic` starts each worker with its stable id: px.init() takes its place in the job; without
    # it a Trainer's elastic fit ran as a group of one beside the job, and px.wrap trained alone
    before_init.setenv("PHALANX_ELASTIC_ID", "w3")
    with pytest.raises(px.ConfigError, match=r"--elastic` worker before px.init\(\); expected px.init\(\) first"):
        px.current_group()
    net = torch.nn.Linear(4, 2)
    with pytest.raises(px.ConfigError, match="px.init"):  # a Trainer joins the group on the user's behalf
        px.Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), F.cross_entropy)
    with pytest.raises(px.ConfigError, match="px.init"):
        px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
