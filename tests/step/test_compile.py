"""torch.compile under phalanx: both orders give the eager result, compile once per input shape, and unwrap.

Supported: ``px.wrap(torch.compile(net), opt)`` and ``torch.compile`` of the module
``px.wrap`` returned. Refused: training through a compiled handle ``px.wrap`` never saw
(DDP's forward is skipped, nothing would be averaged). The equivalence runs use
``backend="aot_eager"`` (dynamo and AOT autograd, no code generation: fast); one
test runs inductor.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.step.compiled import compilations, graph_breaks, is_compiled, original
from support.procs import run_workers
from workers.compiled import CASES, EXACT

pytestmark = pytest.mark.usefixtures("one_thread")
EPOCHS = 2  # 8 steps of two input shapes each: a recompilation per step would show as 8, not 2


@pytest.fixture(scope="module")
def two_workers() -> list[dict]:
    return run_workers("workers.compiled:equivalence", world_size=2, timeout=300, cases=list(CASES),
                       orders=["before", "after"], backend="aot_eager", epochs=EPOCHS).results


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("order", ["before", "after"])
def test_compiled_equals_eager_and_compiles_once_per_shape(two_workers, case: str, order: str) -> None:
    for rank, out in enumerate(two_workers):
        compiled, eager = out[f"{case}/{order}"], out[f"{case}/eager"]
        assert compiled["steps"] == eager["steps"] == EPOCHS * 4
        assert torch.allclose(compiled["params"], eager["params"], atol=1e-6), (rank, case, order)
        if case in EXACT:  # 2 workers x b equal 1 process x 2b, compiled
            assert torch.allclose(compiled["params"], out["oracle"], atol=1e-5), (rank, case, order)
        assert compiled["graphs"] <= 2, compiled["graphs"]  # rank 0 sees batches of 4 and 2, rank 1 of 4 and 1
        # torch's own DDP forward breaks its graph twice per compilation when compiled around it; nothing per step
        assert compiled["breaks"] <= (4 if (case, order) == ("allreduce", "after") else 0), compiled["breaks"]
    assert torch.equal(two_workers[0][f"{case}/{order}"]["params"], two_workers[1][f"{case}/{order}"]["params"])


def test_a_compiled_handle_px_wrap_never_saw_is_refused(two_workers) -> None:
    for out in two_workers:
        assert out["bypassed"].startswith("a backward pass whose forward bypassed the module px.wrap returned")
        assert "px.wrap(torch.compile(net), opt)" in out["bypassed"]


def test_unwrap_save_and_no_sync_see_the_plain_module(tmp_path) -> None:
    """Keys without ``_orig_mod.``, and px.no_sync on a compiled module, in both orders (group of one)."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 2))
    compiled = torch.compile(net, backend="eager")
    assert is_compiled(compiled) and not is_compiled(net) and original(compiled) is net
    model, opt = px.wrap(compiled, torch.optim.SGD(net.parameters(), lr=0.1))  # compile, then wrap
    assert px.unwrap(model) is net
    px.save(model, tmp_path / "m.pt")
    assert set(torch.load(tmp_path / "m.pt")) == {"0.weight", "0.bias"}
    with pytest.raises(px.ConfigError, match="already wrapped"):
        px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))

    net2 = torch.nn.Sequential(torch.nn.Linear(3, 2))
    model2, opt2 = px.wrap(net2, torch.optim.SGD(net2.parameters(), lr=0.1))
    model2 = torch.compile(model2, backend="eager")  # wrap, then compile
    assert px.unwrap(model2) is net2
    with px.no_sync(model2):
        model2(torch.ones(2, 3)).sum().backward()
    assert px.strategy_of(opt2).steps == 0  # accumulated only


def test_inductor_group_of_one_equals_eager() -> None:
    """The real compiler (C++ code generation on CPU) behind px.wrap: the eager result, one graph per shape."""
    if os.system("which g++ > /dev/null 2>&1") != 0:
        pytest.skip("inductor on CPU needs a C++ compiler (g++)")
    torch.compiler.reset()
    results = []
    for compile_it in (False, True):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
        model, opt = px.wrap(torch.compile(net) if compile_it else net, opt)
        graphs0, breaks0 = compilations(), graph_breaks()
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            x, y = torch.randn(6, 8, generator=gen), torch.randint(0, 3, (6,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    assert compilations() - graphs0 == 1 and graph_breaks() == breaks0
    assert torch.allclose(results[0], results[1], atol=1e-5)
