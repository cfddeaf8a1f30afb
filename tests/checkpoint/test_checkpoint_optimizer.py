"""Optimizer state in checkpoints: a checkpoint whose optimizer kept state for some parameters only loads back into
what wrote it, exactly; the state of another optimizer (another class, other param groups) is refused with one
CheckpointError before anything changes. Both formats: the DCP directory and the one-file format of earlier versions.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx.checkpoint import FORMAT
from phalanx.checkpoint.training_state import TrainingState
from phalanx.framing import write_verified


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3), nn.Linear(3, 2))


def two_groups(model: nn.Module) -> torch.optim.Optimizer:
    """One group SGD with momentum 0 (torch keeps no state for it), another with momentum."""
    return torch.optim.SGD([{"params": model[0].parameters(), "momentum": 0.0},
                            {"params": [*model[2].parameters(), *model[3].parameters()], "momentum": 0.9}], lr=0.1)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, head: bool = True) -> None:
    """``head=False``: the last layer is not used, so it never gets a gradient (a frozen or unused head)."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        opt.zero_grad()
        out = model[:3](torch.randn(8, 5, generator=gen))
        out = model[3](out) if head else out
        F.mse_loss(out, torch.zeros_like(out)).backward()
        opt.step()


def save(path: str, model: nn.Module, opt: torch.optim.Optimizer, fmt: str) -> str:
    if fmt == "dcp":
        px.save_checkpoint(path, model, opt, step=2)
    else:  # the one-file format earlier versions wrote (still loaded)
        path += ".pt"
        write_verified(path, {"format": FORMAT, "world_size": 1, "step": 2, "extra": {},
                              "ranks": [TrainingState(model, opt, step=2).capture()]})
    return path


def same(a, b) -> bool:  # noqa: ANN001
    """Equal nested state: same keys, same tensors bit for bit, same plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


FORMATS = ["dcp", "one-file"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", ["sgd-with-a-momentum-0-group", "adamw-with-a-head-that-got-no-gradient"])
def test_optimizer_state_for_some_parameters_only_loads_back_exactly(tmp_path, fmt, case):
    make, head = (two_groups, True) if case.startswith("sgd") else (adamw, False)
    model = net()
    opt = make(model)
    train(model, opt, 2, head=head)
    assert 0 < len(opt.state) < len(list(model.parameters()))  # state for some parameters only
    path = save(str(tmp_path / "ckpt"), model, opt, fmt)
    saved = copy.deepcopy(opt.state_dict())

    fresh = net(seed=9)
    fresh_opt = make(fresh)
    assert px.load_checkpoint(path, fresh, fresh_opt)["step"] == 2
    assert same(fresh_opt.state_dict(), saved)  # the resumed optimizer is the saved one
    train(model, opt, 2, head=head)  # and the run goes on exactly
    train(fresh, fresh_opt, 2, head=head)
    assert same(fresh.state_dict(), model.state_dict()) and same(fresh_opt.state_dict(), opt.state_dict())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", ["adamw-into-sgd", "two-groups-into-one", "partial-adamw-into-sgd"])
def test_another_optimizers_state_is_one_error_before_anything_changes(tmp_path, fmt, case):
    saver, loader = {"adamw-into-sgd": (adamw, sgd), "two-groups-into-one": (two_groups, sgd),
                     "partial-adamw-into-sgd": (adamw, sgd)}[case]
    model = net()
    opt = saver(model)
    train(model, opt, 2, head=case != "partial-adamw-into-sgd")
    path = save(str(tmp_path / "ckpt"), model, opt, fmt)

    other = net(seed=9)
    other_opt = loader(other)
    train(other, other_opt, 1)
    before, before_opt = copy.deepcopy(other.state_dict()), copy.deepcopy(other_opt.state_dict())
    with pytest.raises(px.CheckpointError) as err:
        px.load_checkpoint(path, other, other_opt)
    text = str(err.value)
    assert "another optimizer" in text and "\n" not in text and os.fspath(path) in text
    if case == "two-groups-into-one":
        assert "2 param group(s)" in text and "1 param group(s)" in text
    else:  # what was saved (the class, when the checkpoint records it) and what it is loading into
        assert "momentum" in text and "SGD" in text and ("AdamW" in text or fmt == "one-file")
    assert same(other.state_dict(), before) and same(other_opt.state_dict(), before_opt)  # nothing changed
    train(other, other_opt, 1)  # and the optimizer still steps


def test_a_param_group_holding_other_parameters_is_refused(tmp_path):
    model = net()
    opt = two_groups(model)
    train(model, opt, 1)
    px.save_checkpoint(tmp_path / "ckpt", model, opt)
    other = net(seed=9)
    swapped = torch.optim.SGD([{"params": other[2].parameters(), "momentum": 0.0},
                               {"params": [*other[0].parameters(), *other[3].parameters()], "momentum": 0.9}], lr=0.1)
    with pytest.raises(px.CheckpointError, match=r"param group 0 holds 2 parameter\(s\) \(0.weight, 0.bias\)"):
        px.load_checkpoint(tmp_path / "ckpt", other, swapped)
