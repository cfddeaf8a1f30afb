"""An asynchronous save's snapshot by fork (phalanx.checkpoint.snapshot.Snapshot): the call forks a child of the worker
that copies its frozen view of the state, and training goes on at once. The oracle of any snapshot: every tensor
changed in place right after the call, the checkpoint holds the values of the call; and it holds exactly what a
synchronous save of the same state holds. A real SIGKILL of the child loses that checkpoint only.
"""
from __future__ import annotations

import os
import signal

import pytest
import torch

import phalanx as px
import phalanx.checkpoint.snapshot as snapshot
import phalanx.checkpoint.writer as writer
from support.wait import until

WAIT_S = 120  # a writer process's start on a loaded 2-core machine
_COPY = snapshot._copy_in_child


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.Tanh(), torch.nn.Linear(96, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 48)).square().mean().backward()
        opt.step()
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds of them: parameters, AdamW's moments and step counts."""
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        for k, v in opt.state[p].items():
            out[f"optim/{i}/{k}"] = v.detach().clone()
    return out


def _loaded(path: str) -> dict[str, torch.Tensor]:
    model, opt = _trained(99)  # other values, overwritten by the load
    px.load_checkpoint(path, model, opt)
    return _state(model, opt)


@pytest.fixture
def forks(monkeypatch):
    """The sizes of the snapshots forked (a spy on the real class: the fork and the child are real), with the
    snapshot by fork turned on (the default is the copy in the call)."""
    seen: list[int] = []
    monkeypatch.setattr(writer, "FORK", True)

    class Counted(snapshot.Snapshot):
        def __init__(self, moves):
            seen.append(len(moves))
            super().__init__(moves)
    monkeypatch.setattr(writer, "Snapshot", Counted)
    return seen


def _gated(moves, tell):  # runs in the forked child: copies only once the test has changed the tensors
    with open(os.environ["PHALANX_TEST_GATE"], "rb") as gate:  # a FIFO: blocks until the test opens it
        gate.read(1)
    _COPY(moves, tell)


@pytest.fixture
def gate(tmp_path, monkeypatch):
    """Open the returned FIFO's write end to let the snapshot's child copy (after the test's writes, whatever the
    scheduling)."""
    fifo = str(tmp_path / "gate")
    os.mkfifo(fifo)
    monkeypatch.setenv("PHALANX_TEST_GATE", fifo)
    monkeypatch.setattr(snapshot, "_copy_in_child", _gated)

    def release() -> None:
        with open(fifo, "wb") as f:
            f.write(b"1")
    return release


def _mutate(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)
            for v in opt.state[p].values():
                v.add_(7.0)


def test_a_forked_snapshot_holds_the_state_of_the_call_whatever_training_writes_after_it(tmp_path, forks, gate):
    model, opt = _trained(0)
    before = _state(model, opt)
    handle = px.save_checkpoint(tmp_path / "async", model, opt, step=2, blocking=False)
    _mutate(model, opt)  # every tensor of the state changed in place at once, before the child copies a byte
    gate()
    handle.wait()
    loaded = _loaded(str(tmp_path / "async"))
    assert loaded.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(loaded[k], v), k  # the values of the call, not the ones written after it
    assert forks == [len(before)]  # every tensor went through the fork (none was copied in the call)


def test_a_forked_snapshot_writes_what_a_synchronous_save_of_the_same_state_writes(tmp_path, forks):
    model, opt = _trained(1)
    px.save_checkpoint(tmp_path / "sync", model, opt, step=2)
    px.save_checkpoint(tmp_path / "async", model, opt, step=2, blocking=False).wait()
    assert forks and forks[0] > 0
    sync, forked = _loaded(str(tmp_path / "sync")), _loaded(str(tmp_path / "async"))
    assert sync.keys() == forked.keys()
    for k, v in sync.items():
        assert v.dtype == forked[k].dtype and torch.equal(v, forked[k]), k
    files = sorted(n for n in os.listdir(tmp_path / "sync") if n.endswith(".distcp"))
    assert files and files == sorted(n for n in os.listdir(tmp_path / "async") if n.endswith(".distcp"))
    for name in files:  # DCP's data files themselves: the same bytes
        assert (tmp_path / "sync" / name).read_bytes() == (tmp_path / "async" / name).read_bytes(), name


def _hold(moves, tell):  # runs in the forked child in place of snapshot._copy_in_child
    with open(os.environ["PHALANX_TEST_HELD"] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.environ["PHALANX_TEST_HELD"] + ".tmp", os.environ["PHALANX_TEST_HELD"])
    signal.pause()  # held until the test's SIGKILL


def test_a_killed_snapshot_child_loses_only_its_checkpoint_and_the_next_save_forks_another(tmp_path, monkeypatch,
                                                                                          forks):
    model, opt = _trained(2)
    first = _state(model, opt)
    held, tmp_path = tmp_path / "held", tmp_path / "ckpts"
    px.save_checkpoint(tmp_path / "step-1", model, opt, step=1)
    monkeypatch.setenv("PHALANX_TEST_HELD", str(held))
    monkeypatch.setattr(snapshot, "_copy_in_child", _hold)
    handle = px.save_checkpoint(tmp_path / "step-2", model, opt, step=2, blocking=False)
    child = None
    try:
        until(lambda: held.exists(), timeout=WAIT_S, what="the snapshot's child holding")
        child = int(held.read_text())
        assert child != os.getpid()
        os.kill(child, signal.SIGKILL)
        with pytest.raises(px.CheckpointError, match=r"killed by signal 9 \(SIGKILL\)") as raised:
            handle.wait()
        assert "step-2" in str(raised.value) and "snapshot process" in str(raised.value)
    finally:
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert sorted(os.listdir(tmp_path)) == ["step-1"]  # only the one in flight lost, nothing left of it
    assert px.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step-1")
    loaded = _loaded(str(tmp_path / "step-1"))
    assert all(torch.equal(loaded[k], v) for k, v in first.items())
    monkeypatch.setattr(snapshot, "_copy_in_child", _COPY)
    px.save_checkpoint(tmp_path / "step-3", model, opt, step=3, blocking=False).wait()  # a new child
    assert len(forks) == 2 and px.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step-3")
    loaded = _loaded(str(tmp_path / "step-3"))
    assert all(torch.equal(loaded[k], v) for k, v in first.items())



def test_tensors_in_shared_memory_are_copied_in_the_call_where_a_fork_would_not_freeze_them(tmp_path, forks,
                                                                                              gate):
    model, opt = _trained(3)
    model[0].share_memory()  # (as for Hogwild or a DataLoader): a fork's child would see later writes to these
    before = _state(model, opt)
    handle = px.save_checkpoint(tmp_path / "async", model, opt, step=2, blocking=False)
    _mutate(model, opt)  # before the child copies
    gate()
    handle.wait()
    loaded = _loaded(str(tmp_path / "async"))
    for k, v in before.items():
        assert torch.equal(loaded[k], v), k
    assert forks == [len(before) - 2]  # every tensor but the shared weight and bias went through the fork


