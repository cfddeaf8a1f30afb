"""An asynchronous save's copy (phalanx.checkpoint.staging): the parameters and the optimizer's state copied beside
training until the next step, the rest in the call. The oracle: the checkpoint equals a synchronous save taken at
the call, whatever training did after it; a tensor written by hand while it was copied fails that save (never
written torn), and the previous checkpoint stays.
"""
from __future__ import annotations

import threading

import pytest
import torch
from torch.optim import optimizer as optim_hooks

import phalanx as px
import phalanx.checkpoint.staging as staging
from phalanx.wrap import clock_of
from phalanx.errors import CheckpointError
from test_checkpoint_snapshot import _loaded, _state, _trained

WAIT_S = 120  # a writer process's start on a loaded 2-core machine


@pytest.fixture
def held(monkeypatch):
    """The copy beside training held until the returned event is set (the call's own copy is not)."""
    go = threading.Event()
    real = staging._copy_beside

    def gated(pairs):
        assert go.wait(WAIT_S), "the test never let the copy run"
        real(pairs)
    monkeypatch.setattr(staging, "_copy_beside", gated)
    return go


def _step(model, opt) -> None:
    opt.zero_grad()
    model(torch.randn(8, 48)).square().mean().backward()
    opt.step()


def test_the_next_step_waits_for_the_copy_and_the_checkpoint_holds_the_state_of_the_call(tmp_path, held):
    model, opt = _trained(3)
    before = _state(model, opt)
    # the copy starts only once the next step has begun (a global pre-hook registered before the save's runs first):
    # without the fence that step would write the parameters and moments while they are copied
    started = optim_hooks.register_optimizer_step_pre_hook(lambda *_: held.set())
    try:
        handle = px.save_checkpoint(str(tmp_path / "c"), model, opt, step=1, blocking=False)
        _step(model, opt)
        _step(model, opt)
        handle.wait()
    finally:
        started.remove()
    loaded = _loaded(str(tmp_path / "c"))
    assert loaded.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(loaded[k], v), k
    assert any(not torch.equal(v, _state(model, opt)[k]) for k, v in before.items())  # training did go on


def test_the_copy_runs_beside_training_in_slices_and_equals_a_synchronous_save(tmp_path, monkeypatch):
    """Only buffers and a rule's state wait in the call; the large tensors go in slices, beside it."""
    monkeypatch.setattr(staging, "SLICE", 1000)
    beside: list[int] = []
    real = staging._copy_beside
    monkeypatch.setattr(staging, "_copy_beside", lambda pairs: (beside.append(len(pairs)), real(pairs)))
    model, opt = _trained(4)
    px.save_checkpoint(str(tmp_path / "sync"), model, opt, step=1)
    px.save_checkpoint(str(tmp_path / "async"), model, opt, step=1, blocking=False).wait()
    sliced = sum(-(-t.numel() // 1000) for t in _state(model, opt).values() if t.numel() > 1000)
    assert sum(beside) >= sliced > 4
    sync, copied = _loaded(str(tmp_path / "sync")), _loaded(str(tmp_path / "async"))
    assert sync.keys() == copied.keys()
    for k, v in sync.items():
        assert v.dtype == copied[k].dtype and torch.equal(v, copied[k]), k


def test_a_parameter_written_by_hand_during_the_copy_fails_that_save_and_the_previous_one_stays(tmp_path, held):
    model, opt = _trained(5)
    path = str(tmp_path / "c")
    px.save_checkpoint(path, model, opt, step=1)
    kept = _loaded(path)
    handle = px.save_checkpoint(path, model, opt, step=2, blocking=False)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # in place, before its copy ran
    held.set()
    with pytest.raises(CheckpointError, match=r"0\.weight.*changed while the asynchronous save was copying it"):
        handle.wait()
    assert px.read_checkpoint(path)["step"] == 1
    for k, v in _loaded(path).items():
        assert torch.equal(v, kept[k]), k


def test_a_fence_with_nothing_copying_returns_and_the_hooks_go_with_the_next_save():
    copy = staging.StateCopy()
    copy.fence()  # nothing started
    src, dst = torch.arange(10.0), torch.zeros(10)
    registered: list[int] = []

    def fences(c):
        registered.append(1)
        return [optim_hooks.register_optimizer_step_pre_hook(lambda *_: c.fence())]
    hooks = dict(optim_hooks._global_optimizer_pre_hooks)
    copy.start(now=[], later=[(dst, src)], fences=fences)
    assert len(optim_hooks._global_optimizer_pre_hooks) == len(hooks) + 1
    copy.finish("a test")
    assert torch.equal(dst, src)
    copy.start(now=[], later=[(dst, src)], fences=fences)  # the first save's hook removed, the second's added
    assert len(optim_hooks._global_optimizer_pre_hooks) == len(hooks) + 1 and len(registered) == 2
    copy.close()  # on the thread that registered them: removed
    assert dict(optim_hooks._global_optimizer_pre_hooks) == hooks


def test_the_fences_hooks_go_with_the_first_forward_after_the_copy_and_do_not_pile_up_over_saves(tmp_path):
    """A plain process's writer lasts one save and ends from DCP's thread, which may not remove an optimizer's hook:
    the next forward after the copy removes them, so a long run of saves leaves no hooks behind."""
    model, opt = _trained(6)
    hooks = dict(optim_hooks._global_optimizer_pre_hooks)
    for i in range(3):
        handle = px.save_checkpoint(str(tmp_path / "c"), model, opt, step=i, blocking=False)
        _step(model, opt)  # its forward keeps them (the copy may still run), its step fences
        handle.wait()
    _step(model, opt)
    assert set(optim_hooks._global_optimizer_pre_hooks) <= set(hooks)  # (another test's may have gone meanwhile)
    assert not model._forward_pre_hooks




def test_a_skipped_step_is_closed_by_the_next_forward_only_after_the_copy(tmp_path, held, monkeypatch):
    """A step skipped (its ``optimizer.step()`` never ran, as GradScaler does on inf) is closed by the next forward,
    which runs the rule's exchange: that forward fences the copy before the clock's own hook runs."""
    torch.manual_seed(7)
    net = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.Tanh(), torch.nn.Linear(96, 5))
    model, opt = px.wrap(net, torch.optim.AdamW(net.parameters(), lr=0.01), strategy=px.AllReduce())
    held.set()
    _step(model, opt)  # AdamW's moments exist
    held.clear()
    clock = clock_of(net)
    main, fenced = threading.get_ident(), []  # training's fences while a step was pending
    real = staging.StateCopy.fence

    def spy(self):
        if threading.get_ident() == main and clock.pending:  # (the save's write fences from DCP's thread too)
            fenced.append(True)
        real(self)
    monkeypatch.setattr(staging.StateCopy, "fence", spy)
    handle = px.save_checkpoint(str(tmp_path / "c"), model, opt, step=1, blocking=False)
    model(torch.randn(8, 48)).square().mean().backward()  # its forward waits for nothing; the step is skipped
    assert clock.pending and not fenced
    held.set()
    model(torch.randn(8, 48))  # this forward closes the skipped step, after fencing the copy
    assert fenced == [True] and not clock.pending  # fenced while the step was still pending: before the clock's hook
    handle.wait()
