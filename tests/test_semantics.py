"""What user code around the optimizer sees, as with one process (real processes, one-process oracles).

Gradient clipping and GradScaler's inf check run between ``backward()`` and ``step()``:
they must see the averaged gradient. A step GradScaler skips on one rank only must not
desynchronise the ranks. An uneven global batch must give one process's gradient.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from support.procs import run_workers

pytestmark = pytest.mark.usefixtures("one_thread")


def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def runs():
    return run_workers("workers.semantics:semantics", world_size=2, timeout=240).results


# -- clipping ----------------------------------------------------------------------------------------
@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["allreduce", "local-warmup"])
def test_clipping_between_backward_and_step_sees_the_average_as_one_process(runs, name):
    clip = runs[0]["clipping"]
    assert min(clip["oracle_norms"]) > 0.05  # every step really clipped
    for rank in (0, 1):
        got = runs[rank]["clipping"]
        assert got[name + "_norms"] == pytest.approx(clip["oracle_norms"], rel=1e-5)  # the global norm, not a local one
        assert worst(got[name], clip["oracle"]) <= 1e-5


@pytest.mark.multiproc
def test_fp16_compressed_allreduce_clips_the_average_within_fp16_rounding(runs):
    clip = runs[0]["clipping"]
    for rank in (0, 1):
        got = runs[rank]["clipping"]
        assert got["fp16_norms"] == pytest.approx(clip["oracle_norms"], rel=2e-3)
        assert worst(got["fp16"], clip["oracle"]) <= 2e-3
    assert worst(runs[0]["clipping"]["fp16"], runs[1]["clipping"]["fp16"]) == 0.0


# -- AMP: GradScaler finds inf on rank 1 only -------------------------------------------------------------
@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["allreduce", "powersgd", "local-sgd", "diloco", "easgd"])
def test_a_step_skipped_on_one_rank_keeps_the_step_count_and_the_replicas_in_step(runs, name):
    a, b = runs[0]["amp"][name], runs[1]["amp"][name]
    assert a["steps"] == b["steps"] == a["state_step"] == 6  # the framework counts skipped steps too
    assert worst(a["params"], b["params"]) == 0.0  # identical after the last sync (finish)
    assert all(torch.isfinite(p).all() for p in a["params"])
    if name in ("allreduce", "powersgd"):  # the inf reached the average: every rank skipped, every scaler backed off
        assert a["scale"] == b["scale"] == 2.0 ** 6
    else:  # local steps: only rank 1 skipped
        assert (a["scale"], b["scale"]) == (2.0 ** 8, 2.0 ** 6)
    if name == "easgd":
        assert worst(a["centre"], b["centre"]) == 0.0


@pytest.mark.multiproc
def test_amp_skip_under_allreduce_is_one_process_skipping_that_step(runs):
    assert worst(runs[0]["amp"]["allreduce"]["params"], runs[0]["amp"]["oracle_allreduce"]) <= 1e-5


@pytest.mark.multiproc
def test_amp_skip_under_local_sgd_is_that_replica_not_stepping(runs):
    """Documented: the skipping rank keeps its replica as it was; the average at the sync includes it."""
    assert worst(runs[0]["amp"]["local-sgd"]["params"], runs[0]["amp"]["oracle_local_sgd"]) <= 1e-5


# -- uneven batches ------------------------------------------------------------------------------------------
@pytest.mark.multiproc
@pytest.mark.parametrize("path", ["allreduce", "topk1", "local-warmup"])
@pytest.mark.parametrize("split", ["3/1", "4/0"])
def test_uneven_batch_weights_give_one_process_gradient(runs, path, split):
    """Rank 0 holds 3 (or all 4) samples, rank 1 the rest (1, or none: its mean loss is NaN)."""
    for rank in (0, 1):
        got = runs[rank]["uneven"][f"{path} {split}"]
        assert worst(got, runs[rank]["uneven"]["oracle"]) <= 1e-6


# -- a group of one ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [px.AllReduce, lambda: px.AllReduce(compression=px.PowerSGD(rank=1)),
                                  lambda: px.LocalSGD(every=2, warmup_steps=2)])
def test_a_group_of_one_is_plain_torch_bit_for_bit_with_a_skipped_step(make):
    def train(strategy):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        model = net
        if strategy is not None:
            model, opt = px.wrap(net, opt, strategy=strategy)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        gen = torch.Generator().manual_seed(1)
        for step in range(5):
            opt.zero_grad()
            loss = F.cross_entropy(model(torch.randn(8, 6, generator=gen)), torch.randint(0, 3, (8,), generator=gen))
            scaler.scale(loss * (float("inf") if step == 2 else 1.0)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
        if strategy is not None:
            strategy.finish()
            assert strategy.steps == 5
        return [p.detach() for p in net.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(make()), train(None), strict=True))


def test_no_sync_accumulates_and_the_step_count_counts_synchronising_passes():
    net = torch.nn.Linear(2, 1)
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=px.LocalSGD(every=2))
    for _ in range(3):
        with px.no_sync(model):
            model(torch.ones(1, 2)).sum().backward()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert px.strategy_of(opt).steps == 3
    with pytest.raises(px.ConfigError, match="px.wrap did not return"):
        with px.no_sync(torch.nn.Linear(2, 1)):
            pass


# -- wrap-time checks and Comm ------------------------------------------------------------------------
@pytest.mark.multiproc
def test_a_model_that_differs_between_ranks_is_refused_on_every_rank_naming_the_tensor(runs):
    assert runs[0]["wrapping"]["refused"].startswith(
        "a model that differs between ranks: rank 0 has '0.weight' of shape (8, 6) (torch.float32) where rank 1 has "
        "'0.weight' of shape (9, 6) (torch.float32); expected the same architecture on every rank")
    assert "rank 1 has '0.weight' of shape (9, 6)" in runs[1]["wrapping"]["refused"]


@pytest.mark.multiproc
def test_wrapping_the_ddp_module_px_wrap_returned_is_one_clear_error(runs):
    assert runs[0]["wrapping"]["rewrapped"].startswith("a DistributedDataParallel module around Sequential; "
                                                       "expected the plain module")


@pytest.mark.multiproc
def test_exchange_with_swaps_tensors_point_to_point_and_counts_the_bytes(runs):
    for rank in (0, 1):
        got = runs[rank]["wrapping"]
        other = 1 - rank
        assert torch.equal(got["theirs"][0], torch.full((3,), float(other)))
        assert torch.equal(got["theirs"][1], torch.arange(2) + 10 * other)
        assert got["bytes"] == 3 * 4 + 2 * 8


def test_wrapping_twice_or_a_ddp_module_is_one_clear_error():
    net = torch.nn.Linear(2, 1)
    model, _ = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(px.ConfigError, match="a Linear that px.wrap already wrapped; expected a model px.wrap"):
        px.wrap(model, torch.optim.SGD(net.parameters(), lr=0.1))


def test_diloco_keeps_its_anchor_and_outer_momentum_in_fp32_for_a_bf16_model():
    net = torch.nn.Linear(4, 2).to(torch.bfloat16)
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=1e-3), strategy=px.DiLoCo(every=2))
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(3, 4, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
    strategy = px.strategy_of(opt)
    state = strategy.state_with_step()
    assert {a.dtype for a in strategy.anchor} == {torch.float32}
    assert {t.dtype for t in state["exchange"]["anchor"] + state["exchange"]["momentum"]} == {torch.float32}
    assert {p.dtype for p in net.parameters()} == {torch.bfloat16} and state["step"] == 2
