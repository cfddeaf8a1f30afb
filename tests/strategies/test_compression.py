"""Compressors, in one process: round-trip bounds, nothing lost under error feedback, state, bad input."""
from __future__ import annotations

import math

import pytest
import torch

import phalanx as px

pytestmark = pytest.mark.usefixtures("one_thread")


EF = {"topk": lambda: px.TopK(0.05), "threshold": lambda: px.Threshold(0.5), "powersgd": lambda: px.PowerSGD(rank=2)}


def spread(n: int, seed: int = 0) -> torch.Tensor:
    """Values over many magnitudes, both signs, a few exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 4, (n,), generator=g)
    x[::97] = 0
    return x


def test_fp16_round_trip_is_within_half_an_ulp():
    fp16 = px.FP16()
    x = spread(10_000)
    payload, ctx = fp16.compress(x)
    assert payload.dtype == torch.float16 and payload.element_size() == 2
    back = fp16.decompress(payload, ctx)
    assert back.dtype == x.dtype
    assert ((back - x).abs() <= 2**-11 * x.abs() + 2**-25).all()


def test_topk_round_trip_keeps_the_largest_exactly_and_bounds_the_rest():
    x = spread(1000, seed=1)
    topk = px.TopK(0.1)
    (values, idx), ctx = topk.compress(x)
    back = topk.decompress((values, idx), ctx)
    k = math.ceil(0.1 * x.numel())
    assert values.numel() == idx.numel() == k and idx.dtype == torch.int32
    sent = torch.zeros_like(x, dtype=torch.bool)
    sent[idx.long()] = True
    assert torch.equal(back[sent], x[sent])  # sent entries are exact
    assert x[~sent].abs().max() <= x[sent].abs().min()  # and they are the largest
    assert (x - back).pow(2).sum() <= (1 - k / x.numel()) * x.pow(2).sum()


def test_threshold_round_trip_sends_exactly_what_passes():
    x = spread(1000, seed=2)
    th = px.Threshold(0.5)
    back = th.decompress(*th.compress(x))
    passed = x.abs() >= 0.5
    assert torch.equal(back[passed], x[passed])
    assert (x - back).abs().max() < 0.5


def test_powersgd_round_trip_is_a_projection_and_exact_at_low_rank():
    g = torch.Generator().manual_seed(3)
    m = torch.randn(64, 48, generator=g)
    psgd = px.PowerSGD(rank=4, error_feedback=False)
    back = psgd.decompress(*psgd.compress(m, "m"))
    assert torch.linalg.norm(m - back) <= torch.linalg.norm(m)
    low = torch.randn(64, 3, generator=g) @ torch.randn(3, 48, generator=g)  # rank 3 <= 4
    back = psgd.decompress(*psgd.compress(low, "low"))
    assert torch.linalg.norm(low - back) <= 1e-5 * torch.linalg.norm(low)
    conv = torch.randn(16, 8, 3, 3, generator=g)  # viewed as 16 x 72
    payload, ctx = psgd.compress(conv, "conv")
    assert psgd.decompress(payload, ctx).shape == conv.shape
    bias = torch.randn(16, generator=g)
    assert torch.equal(psgd.decompress(*psgd.compress(bias, "bias")), bias)  # vectors travel dense


def test_powersgd_warm_start_converges_to_the_best_rank_r_approximation():
    g = torch.Generator().manual_seed(4)
    u, _ = torch.linalg.qr(torch.randn(50, 50, generator=g))
    v, _ = torch.linalg.qr(torch.randn(40, 40, generator=g))
    s = torch.tensor([10.0, 8.0, 6.0, 1.0, 0.5] + [0.1] * 35)
    m = u[:, :40] @ torch.diag(s) @ v.t()
    psgd = px.PowerSGD(rank=3, error_feedback=False)
    errors = [torch.linalg.norm(m - psgd.decompress(*psgd.compress(m, "m"))).item() for _ in range(30)]
    best = s[3:].norm().item()  # Eckart-Young
    assert errors[-1] <= 1.001 * best
    assert errors[-1] < errors[0] or errors[0] <= 1.001 * best


@pytest.mark.parametrize("name", sorted(EF))
def test_nothing_is_lost_under_error_feedback(name):
    """sum(transmitted) + residual == sum(true tensors), after any number of rounds."""
    c = EF[name]()
    g = torch.Generator().manual_seed(5)
    truth = torch.zeros(20, 30, dtype=torch.float64)
    sent = torch.zeros(20, 30, dtype=torch.float64)
    for _ in range(25):
        grad = torch.randn(20, 30, generator=g)
        truth += grad
        sent += c.decompress(*c.compress(grad, "w")).double()
    residual = c.residuals["w"].double()
    assert torch.allclose(sent + residual, truth, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(EF))
def test_nothing_is_lost_through_average_in_a_group_of_one(name):
    """The collective path keeps the same books: what average_ delivers plus the residuals."""
    c = EF[name]()
    comm = px.Comm()
    g = torch.Generator().manual_seed(6)
    shapes = [(20, 30), (30,), (8, 4, 3, 3)]
    truth = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    sent = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for _ in range(15):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for t, gr in zip(truth, grads, strict=True):
            t += gr
        c.average_(grads, comm, key="grad")
        for s, gr in zip(sent, grads, strict=True):
            s += gr
    if name == "powersgd":  # one residual per compressible tensor; vectors travel exact
        assert sorted(c.residuals) == ["grad.0", "grad.2"]
        for i, (t, s) in enumerate(zip(truth, sent, strict=True)):
            r = c.residuals.get(f"grad.{i}")
            assert torch.allclose(s + (r.double() if r is not None else 0), t, atol=1e-4)
    else:  # one residual over the concatenation
        total = torch.cat([s.reshape(-1) for s in sent]) + c.residuals["grad"].double()
        assert torch.allclose(total, torch.cat([t.reshape(-1) for t in truth]), atol=1e-4)


@pytest.mark.parametrize("name", sorted(EF))
def test_state_dict_resumes_exactly(name):
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(12, 10, generator=g) for _ in range(6)]
    a = EF[name]()
    for grad in grads[:3]:
        a.compress(grad, "w")
    b = EF[name]()
    b.load_state_dict(a.state_dict())
    b.load_replica_state_dict(a.replica_state_dict())
    for grad in grads[3:]:
        out_a, out_b = a.decompress(*a.compress(grad, "w")), b.decompress(*b.compress(grad, "w"))
        assert torch.equal(out_a, out_b)


@pytest.mark.parametrize("name", sorted(EF))
def test_residuals_are_this_workers_own_and_only_the_warm_start_is_shared(name):
    c = EF[name]()
    c.compress(torch.randn(12, 10, generator=torch.Generator().manual_seed(3)), "w")
    assert "residuals" not in c.state_dict() and set(c.replica_state_dict()) == {"residuals"}
    assert set(c.state_dict()) == ({"qs"} if name == "powersgd" else set())
    joiner = EF[name]()  # takes the shared part only, as a joiner or a resize takes rank 0's
    joiner.load_state_dict(c.state_dict())
    assert joiner.residuals == {} and joiner.replica_state_dict() == {"residuals": {}}
    c.load_state_dict(joiner.state_dict())  # loading shared state leaves this worker's residuals alone
    assert set(c.residuals) == {"w"}


@pytest.mark.parametrize("strategy", [lambda c: px.AllReduce(compression=c),
                                      lambda c: px.DiLoCo(every=2, compression=c)])
def test_a_joiner_takes_rank_0s_warm_start_but_starts_with_zero_residuals(strategy):
    from phalanx.checkpoint.training_state import TrainingState, shared

    def wrapped():
        net = torch.nn.Linear(12, 10)
        c = px.PowerSGD(rank=2)
        return (c, *px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=strategy(c)))

    c0, model0, opt0 = wrapped()
    c0.compress(torch.randn(10, 12), "w")  # rank 0's residual and warm start
    snapshot = TrainingState(model0, opt0).capture()
    c1, model1, opt1 = wrapped()
    TrainingState(model1, opt1).restore(shared(snapshot))  # what a joiner (or a resume on another world size) takes
    assert c1.residuals == {} and set(c1.qs) == {"w"} and torch.equal(c1.qs["w"], c0.qs["w"])
    TrainingState(model0, opt0).restore(snapshot)  # a worker's own rollback keeps both
    assert set(c0.residuals) == {"w"} and set(c0.qs) == {"w"}


@pytest.mark.parametrize("make, says", [
    (lambda: px.TopK(0), "(0, 1]"), (lambda: px.TopK(1.5), "(0, 1]"), (lambda: px.TopK(-0.1), "(0, 1]"),
    (lambda: px.TopK("0.1"), "(0, 1]"), (lambda: px.Threshold(0), "> 0"), (lambda: px.Threshold(-1), "> 0"),
    (lambda: px.PowerSGD(rank=0), ">= 1"), (lambda: px.PowerSGD(rank=2.5), ">= 1"),
])
def test_bad_hyperparameters_name_the_value_and_the_range(make, says):
    with pytest.raises(ValueError, match=r"expected .*" + __import__("re").escape(says)) as err:
        make()
    assert isinstance(err.value, px.ConfigError)


def test_a_topk_ratio_above_one_half_warns_that_it_sends_more():
    with pytest.warns(UserWarning, match="more bytes than the dense"):
        px.TopK(0.75)


def test_fp16_average_in_a_group_of_one_is_a_rounding():
    x = [torch.randn(5, 5), torch.randn(5)]
    before = [t.clone() for t in x]
    px.FP16().average_(x, px.Comm())
    for b, a in zip(before, x, strict=True):
        assert torch.equal(a, b.half().float())


def test_topk_on_a_large_tensor_is_the_exact_top_k():
    """Large tensors take a sampled-threshold shortcut; it must select exactly what topk does."""
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(8)) ** 3
    (values, idx), _ = px.TopK(0.01, error_feedback=False).compress(x)
    expected = x.abs().topk(3000).indices
    assert torch.equal(idx.long().sort().values, expected.sort().values)
    assert torch.equal(values, x[idx.long()])


def test_a_checkpoint_loaded_on_another_world_size_keeps_rank_0s_warm_start_and_no_residuals(tmp_path):
    from phalanx.checkpoint import FORMAT, write_verified
    from phalanx.checkpoint.training_state import TrainingState

    def wrapped():
        net = torch.nn.Linear(12, 10)
        c = px.PowerSGD(rank=2)
        return (c, *px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=px.AllReduce(compression=c)))

    c0, model0, opt0 = wrapped()
    c0.compress(torch.randn(10, 12), "w")
    snap = TrainingState(model0, opt0).capture()
    # a file as 2 workers write it, loaded here by 1: every worker takes rank 0's shared part
    write_verified(tmp_path / "ckpt.pt", {"format": FORMAT, "world_size": 2, "step": 0, "extra": {},
                                          "ranks": [snap, {**snap, "rank": 1}]})
    c1, model1, opt1 = wrapped()
    with pytest.warns(UserWarning, match="taken with 2 workers"):
        px.load_checkpoint(tmp_path / "ckpt.pt", model1, opt1)
    assert c1.residuals == {} and torch.equal(c1.qs["w"], c0.qs["w"])
