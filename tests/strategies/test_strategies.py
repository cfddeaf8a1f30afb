"""Strategies on the template: bad input and group-of-one behaviour (unit), then real 2-worker runs.

The multi-process tests share one worker launch (module fixtures): the exact checks
(equivalences, the EASGD oracle, resume, bytes, the docs' custom rule), then every strategy
and compressor trained to the convergence bar, in a single pair of processes.
"""
from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.bench.models import digits_cnn
from phalanx.strategies import REGISTRY, by_name
from support.procs import run_workers

# The budget AllReduce is given, and every other strategy must live within. At 5 epochs the bar tells a working
# compressor from one without error feedback, which 8 epochs and 0.93 did not (TopK(0.01) without it: 0.76 at 5
# epochs, 0.949 at 8; PowerSGD(4): 0.88, 0.971); the working ones reach 0.926 (TopK) to 0.978 (docs/strategies.md).
EPOCHS = 5
BAR = 0.90


pytestmark = pytest.mark.usefixtures("one_thread")


def close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 1e-5) -> float:
    """Largest relative difference between two lists of tensors (asserted <= tol)."""
    worst = max(((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item() for x, y in zip(a, b, strict=True))
    assert worst <= tol, worst
    return worst


# -- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, says", [
    (lambda: px.LocalSGD(every=0), "every=0; expected an integer >= 1"),
    (lambda: px.LocalSGD(every=-3), "every=-3; expected an integer >= 1"),
    (lambda: px.LocalSGD(every=2.5), "every=2.5; expected an integer >= 1 or a sync condition"),
    (lambda: px.LocalSGD(every=4, warmup_steps=-1), "warmup_steps=-1); expected an integer >= 0"),
    (lambda: px.DiLoCo(every=0), "every=0; expected an integer >= 1"),
    (lambda: px.DiLoCo(outer_lr=0), "outer_lr=0); expected a finite number > 0"),
    (lambda: px.DiLoCo(outer_momentum=1.0), "outer_momentum=1.0); expected a number in [0, 1)"),
    (lambda: px.EASGD(every=0), "every=0; expected an integer >= 1"),
    (lambda: px.EASGD(alpha=0), "alpha=0); expected 0 < alpha <= 1/p"),
    (lambda: px.EASGD(alpha=1.5), "alpha=1.5); expected 0 < alpha <= 1/p"),
    (lambda: px.AsyncEASGD(alpha=2.0), "alpha=2.0; expected 0 < alpha < 1"),
    (lambda: px.schedule(sync_steps=-1, then=px.every(4)), "sync_steps=-1; expected an integer >= 0"),
    (lambda: px.LocalSGD(every=8, compression=px.FP16()), "LocalSGD(compression=FP16()); expected no compressor"),
    (lambda: px.EASGD(compression=px.TopK(0.1)), "EASGD(compression=TopK(0.1)); expected no compressor"),
    (lambda: px.AllReduce(compression="fp16"), "compression='fp16'); expected None or a compressor object"),
    (lambda: px.AllReduce(compression=px.FP16), "compression=FP16); expected a compressor object"),
    (lambda: px.DiLoCo(compression=torch.optim.SGD), "expected None or a compressor object"),
])
def test_bad_settings_raise_value_errors_naming_value_and_range(make, says):
    with pytest.raises(ValueError, match=re.escape(says)) as err:
        make()
    assert isinstance(err.value, px.ConfigError)


def test_easgd_takes_no_asynchronous_flag_the_async_variant_is_its_own_class():
    with pytest.raises(TypeError):
        px.EASGD(every=8, asynchronous=True)
    assert px.AsyncEASGD(every=8, alpha=0.3).alpha == 0.3


def test_easgd_alpha_is_checked_against_the_number_of_workers():
    from phalanx.strategies.easgd import Elastic

    class TwoWorkers:  # setup only reads the world size
        world_size = 2

    with pytest.raises(ValueError, match=re.escape("expected 0 < alpha <= 1/p = 0.5")):
        Elastic(0.6).setup([torch.nn.Parameter(torch.zeros(2))], TwoWorkers())
    ok = Elastic(None)
    ok.setup([torch.nn.Parameter(torch.zeros(2))], TwoWorkers())
    assert ok.alpha == pytest.approx(0.45)  # the paper's beta = p * alpha = 0.9


def test_local_sgd_every_1_warns_and_says_why():
    with pytest.warns(UserWarning, match=r"px\.AllReduce\(\)"):
        px.LocalSGD(every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        px.LocalSGD(every=2)


def test_schedule_is_synchronous_first_then_periodic():
    rule = px.schedule(sync_steps=3, then=px.every(4))
    assert [s for s in range(1, 16) if rule(s)] == [1, 2, 3, 7, 11, 15]
    assert [rule.synchronous(s) for s in (1, 3, 4)] == [True, True, False]
    assert px.schedule(sync_steps=2, then=5) == px.schedule(sync_steps=2, then=px.every(5))
    assert repr(px.LocalSGD(every=8, warmup_steps=10)) == "LocalSGD(schedule(sync_steps=10, then=every(8)))"
    assert repr(px.LocalSGD(every=rule)) == f"LocalSGD({rule!r})"


@pytest.mark.parametrize("name", ["local-sgd", "local_sgd", "post-local-sgd", "diloco", "easgd", "fp16", "topk",
                                  "threshold", "powersgd", "allreduce"])
def test_every_registered_name_wraps_and_trains_in_a_group_of_one(name):
    strategy = by_name(name)
    net = digits_cnn()
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05), strategy=name)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(torch.rand(4, 1, 8, 8)), torch.arange(4)).backward()
        opt.step()
    got = px.strategy_of(opt)
    assert type(got) is type(strategy) and got.steps == 3 and got.bytes_sent == 0
    got.finish()
    assert name.replace("_", "-") in REGISTRY


def test_powersgd_by_name_is_allreduce_with_rank_4():
    s = by_name("powersgd")
    assert isinstance(s, px.AllReduce) and isinstance(s.compression, px.PowerSGD) and s.compression.rank == 4


def test_periodic_strategies_are_plain_training_in_a_group_of_one():
    """One worker: nothing to average, so LocalSGD and EASGD's elastic pull (to itself) change nothing."""
    def train(strategy):
        torch.manual_seed(0)
        net = digits_cnn()
        model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), strategy=strategy)
        torch.manual_seed(1)
        for _ in range(6):
            opt.zero_grad()
            F.cross_entropy(model(torch.rand(8, 1, 8, 8)), torch.randint(0, 10, (8,))).backward()
            opt.step()
        return [p.detach().clone() for p in net.parameters()]

    plain = train(px.AllReduce())
    close(train(px.LocalSGD(every=2)), plain, tol=0)
    close(train(px.DiLoCo(every=2, outer_lr=1.0, outer_momentum=0.0)), plain, tol=1e-5)


# -- real worker processes ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """Both launches in one: the exact checks, then the convergence runs, in the same pair of processes."""
    ckpt = tmp_path_factory.mktemp("strategy-ckpt")
    return run_workers("workers.strategies:exactness_then_convergence", world_size=2, timeout=480,
                       ckpt_dir=str(ckpt), epochs=EPOCHS).results


@pytest.fixture(scope="module")
def exact(both):
    return [rank["exact"] for rank in both]


@pytest.fixture(scope="module")
def trained(both):
    return [rank["trained"] for rank in both]


@pytest.mark.multiproc
def test_local_sgd_every_1_with_sgd_equals_allreduce(exact):
    for rank in exact:
        close(rank["local1"], rank["allreduce"])
    assert any("px.AllReduce()" in w for w in exact[0]["warned"])


@pytest.mark.multiproc
def test_diloco_with_unit_outer_lr_and_no_momentum_equals_local_sgd_every_1(exact):
    for rank in exact:
        close(rank["diloco1"], rank["local1"])


@pytest.mark.multiproc
def test_post_local_sgd_warmup_is_true_gradient_averaging_even_under_adam(exact):
    for rank in exact:
        close(rank["warmup_adam"], rank["allreduce_adam"])


@pytest.mark.multiproc
def test_easgd_follows_the_papers_update_rule(exact):
    from workers.strategies import easgd_oracle

    oracle = easgd_oracle(steps=8, every=2, alpha=0.3, lr=0.1)
    for rank, result in enumerate(exact):
        close(result["easgd_centre"], oracle["centre"])  # the same centre on every worker
        close(result["easgd_params"], oracle["replicas"][rank])
    drift = [(a - b).abs().max().item()
             for a, b in zip(exact[0]["easgd_params"], exact[1]["easgd_params"], strict=True)]
    assert max(drift) > 0  # the workers themselves differ: only the centre is shared


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["diloco", "powersgd", "local-sgd"])
def test_resume_with_strategy_state_continues_exactly(exact, name):
    """Checkpoint mid-round (replicas differ, residuals and momentum per rank), resume in fresh objects."""
    for rank in exact:
        close(rank["resume"][name]["resumed"], rank["resume"][name]["straight"], tol=1e-6)


@pytest.mark.multiproc
def test_bytes_per_step_are_the_compressed_sizes(exact):
    n = sum(p.numel() for p in digits_cnn().parameters())
    shapes = [p.shape for p in digits_cnn().parameters()]
    got = exact[0]["bytes"]
    flags = 4 * len(shapes)  # compressed paths: one float32 per parameter says which ones some rank reached
    assert got["allreduce"] == 4 * n
    assert got["fp16"] == 2 * n + flags
    assert got["topk"] == 8 * math.ceil(0.01 * n) + flags
    r = 2  # PowerSGD: P (n*r) with the vectors, then Q (m*r), float32
    matrices = [(s[0], math.prod(s[1:])) for s in shapes if len(s) >= 2 and (s[0] + math.prod(s[1:])) * r <
                s[0] * math.prod(s[1:])]
    vectors = sum(math.prod(s) for s in shapes if not (len(s) >= 2 and (s[0], math.prod(s[1:])) in matrices))
    assert got["powersgd"] == 4 * (vectors + sum((a + b) * r for a, b in matrices)) + flags
    share = 4  # LocalSGD / DiLoCo: each replica's share of the samples rides with the average (one float32)
    assert got["local8"] == (4 * n + share) / 8 and got["diloco8"] == (4 * n + share) / 8


@pytest.mark.multiproc
def test_the_custom_rule_in_the_docs_runs_on_two_workers(exact):
    """docs/strategies.md's MajorityVote, extracted verbatim: replicas agree, 1 byte per entry, it learns."""
    n = sum(p.numel() for p in digits_cnn().parameters())
    doc0, doc1 = exact[0]["doc"], exact[1]["doc"]
    close(doc0["params"], doc1["params"], tol=0)
    assert doc0["bytes_per_step"] == n
    assert sum(doc0["losses"][-5:]) < sum(doc0["losses"][:5])
    assert doc0["state"]["ties"] == doc1["state"]["ties"] >= 0


@pytest.mark.multiproc
def test_every_strategy_and_compressor_converges_within_allreduces_epoch_budget(trained):
    """Digits CNN, 2 workers x batch 32, EPOCHS epochs each; test accuracy of the model kept after finish()."""
    results = trained[0]
    assert "allreduce" in results and len(results) >= 10
    report = {name: round(r["accuracy"], 4) for name, r in results.items()}
    sent = {name: round(r["bytes_per_step"]) for name, r in results.items()}
    print(f"test accuracy after {EPOCHS} epochs (bar {BAR}): {report}; bytes per step: {sent}")  # docs/strategies.md
    assert all(acc >= BAR for acc in report.values()), report
    for name, r in results.items():  # after finish() every replica holds the same model
        close(r["params"], trained[1][name]["params"], tol=0)
    full = results["allreduce"]["bytes_per_step"]
    assert all(r["bytes_per_step"] < full for name, r in results.items() if name != "allreduce")
