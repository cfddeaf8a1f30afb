"""The end-of-backward hook (phalanx.step.backward) and the one private torch attribute it needs (step._engine)."""
from __future__ import annotations

import torch

from phalanx.step import _engine
from phalanx.step.backward import after_backward


def test_engine_callback_runs_once_after_every_grad_is_accumulated_before_backward_returns():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    seen = []

    def queue(_param):
        if not seen:
            seen.append("queued")
            _engine.queue_callback(lambda: seen.append((a.grad.tolist(), b.grad.tolist())))

    for p in (a, b):
        p.register_post_accumulate_grad_hook(queue)
    ((2 * a).sum() + (3 * b).sum()).backward()
    assert seen == ["queued", ([2.0] * 3, [3.0] * 2)]


def test_one_callback_per_pass_with_retain_graph_unused_parameters_and_accumulation():
    used, unused = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    grads = []
    handle = after_backward([used, unused], lambda: grads.append((used.grad.clone(), unused.grad)))
    loss = (used * used).sum()
    loss.backward(retain_graph=True)
    loss.backward()                       # the same graph again: one more callback, grads accumulated
    with handle.paused():
        loss2 = (used * 5).sum()
        loss2.backward()                  # accumulation only: no callback
    (used * 1).sum().backward()
    assert [g.tolist() for g, _ in grads] == [[2.0, 2.0], [4.0, 4.0], [10.0, 10.0]]
    assert all(u is None for _, u in grads)   # a parameter with no gradient does not block the callback
    handle.remove()
    (used * 1).sum().backward()
    assert len(grads) == 3


def test_a_callback_that_raises_comes_out_of_backward_and_the_next_pass_still_calls_back():
    w = torch.nn.Parameter(torch.ones(1))
    calls = []

    def cb():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")

    after_backward([w], cb)
    try:
        (w * 2).sum().backward()
    except RuntimeError as err:
        assert "boom" in str(err)
    else:
        raise AssertionError("the callback's error was swallowed")
    (w * 2).sum().backward()
    assert calls == [1, 1]


def test_no_callback_for_autograd_grad_that_accumulates_nothing():
    w = torch.nn.Parameter(torch.ones(2))
    calls = []
    after_backward([w], lambda: calls.append(1))
    torch.autograd.grad((w * 2).sum(), [w])
    assert calls == []
