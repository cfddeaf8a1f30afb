"""What a load refuses with one CheckpointError rather than a raw Python error, before anything changes: a symbolic
link loop, an RNG state that cannot be set, a flipped bit in DCP's ``.metadata``.
"""
from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.checkpoint import FORMAT
from phalanx.checkpoint.training_state import TrainingState
from phalanx.cli import main as cli
from phalanx.framing import read_verified, write_verified
from phalanx.sealed import digest_file, write_marker


def trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def refused(path, model: nn.Module, opt: torch.optim.Optimizer) -> str:  # noqa: ANN001
    """The one line px.load_checkpoint refuses ``path`` with; the model and optimizer must be untouched."""
    before, before_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    with pytest.raises(px.CheckpointError) as err:
        px.load_checkpoint(path, model, opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert str(opt.state_dict()) == str(before_opt)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_symbolic_link_loop_is_one_checkpoint_error(tmp_path, capsys):
    model, opt = trained()
    loop = tmp_path / "loop"
    os.symlink(loop, loop)  # the checkpoint's path itself
    assert "Too many levels of symbolic links" in refused(loop, model, opt)
    with pytest.raises(px.CheckpointError):
        px.read_checkpoint(loop)
    assert cli(["export", str(loop), str(tmp_path / "m.pt")]) == 1 and "symbolic links" in capsys.readouterr().err
    px.save_checkpoint(tmp_path / "ckpt", model, opt)
    os.remove(tmp_path / "ckpt" / "rank-0.pt")  # a file inside it
    os.symlink(tmp_path / "ckpt" / "rank-0.pt", tmp_path / "ckpt" / "rank-0.pt")
    assert "rank-0.pt" in refused(tmp_path / "ckpt", *trained(1))


@pytest.mark.parametrize("fmt", ["dcp", "one-file"])
def test_an_rng_state_that_cannot_be_set_is_refused_before_the_model_is_loaded(tmp_path, fmt):
    model, opt = trained()
    if fmt == "dcp":
        path = tmp_path / "ckpt"
        px.save_checkpoint(path, model, opt)
        body = read_verified(path / "rank-0.pt")
        body["rng"]["torch"] = torch.zeros(7, dtype=torch.uint8)  # edited, then framed again: its hash is valid
        write_verified(path / "rank-0.pt", body)
        marker = json.loads((path / "phalanx.json").read_text())  # and the marker vouches for the edited file
        marker["files"]["rank-0.pt"] = digest_file(str(path), "rank-0.pt")
        write_marker(str(path), {k: marker[k] for k in ("format", "world_size", "step")}, marker["files"])
    else:
        path = tmp_path / "ckpt.pt"
        snapshot = TrainingState(model, opt).capture()
        snapshot["rng"]["numpy"]["keys"] = torch.zeros(5, dtype=torch.int64)
        write_verified(path, {"format": FORMAT, "world_size": 1, "step": 0, "extra": {}, "ranks": [snapshot]})
    other, other_opt = trained(1)
    torch.manual_seed(5)
    draw = torch.rand(3)
    torch.manual_seed(5)
    assert "RNG state" in refused(path, other, other_opt)
    assert torch.equal(torch.rand(3), draw)  # this process's generators are as they were too
    px.load_checkpoint(path, other, other_opt, restore_rng=False)  # the way out the message names
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in other.state_dict().items())


@pytest.mark.parametrize("field", ["state_dict_metadata", "properties", "chunks", "storage_data", "relative_path"])
def test_a_flipped_bit_in_the_dcp_metadata_is_one_checkpoint_error(tmp_path, field):
    model, opt = trained()
    px.save_checkpoint(tmp_path / "ckpt", model, opt)
    bad = tmp_path / "flipped"
    shutil.copytree(tmp_path / "ckpt", bad)
    data = bytearray((bad / ".metadata").read_bytes())
    at = data.find(field.encode())
    assert at >= 0
    data[at] ^= 0x01  # one bit of the field's name: the class is built without that field
    (bad / ".metadata").write_bytes(bytes(data))
    assert ".metadata" in refused(bad, *trained(1))
    with pytest.raises(px.CheckpointError):
        px.read_checkpoint(bad)
