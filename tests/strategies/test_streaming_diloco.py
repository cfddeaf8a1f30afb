"""Streaming DiLoCo (arXiv 2501.18512) and the block quantiser.

Unit: bad input, the fragment split, the quantiser's round-trip bounds on any shape, one
process equal to DiLoCo. Multi-process (2 gloo workers): P = 1, τ = 0 equals px.DiLoCo
bit for bit; P = 2, τ = 1 follows the paper's Algorithm 1 computed in one process, and with
``mixing="eager"`` the eager-updates rule (arXiv 2502.12996) computed the same way; the
quantised exchanges train. Elastic (3 workers): a kill while an exchange is in flight, and a
spare joining in the lost worker's place mid-overlap, both against a one-process replay.
"""
from __future__ import annotations

import glob
import json
import math
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.strategies.fragments import balanced_split, value_split
from support.loop import lockstep
from support.forked_launch import run_cli
from support.procs import run_workers
from workers import streaming
from support.paths import TESTS

STEPS = 8


# -- bad input: one clear line each -----------------------------------------------------------------------------------
@pytest.mark.parametrize("make, says", [
    (lambda: px.StreamingDiLoCo(every=4, overlap=4), "overlap < every"),
    (lambda: px.StreamingDiLoCo(every=4, overlap=-1), "overlap=-1"),
    (lambda: px.StreamingDiLoCo(fragments=0), "fragments=0"),
    (lambda: px.StreamingDiLoCo(quantize=3), "None, 8, 4 or a compressor"),
    (lambda: px.StreamingDiLoCo(mixing=1.5), "mixing=1.5"),
    (lambda: px.StreamingDiLoCo(mixing="lazy"), "or \"eager\""),
    (lambda: px.StreamingDiLoCo(moments=("velocity",)), "distinct names among momentum, exp_avg"),
    (lambda: px.StreamingDiLoCo(moments=("exp_avg", "exp_avg")), "moments=('exp_avg', 'exp_avg')"),
    (lambda: px.StreamingDiLoCo(quantize=4, moments=("momentum", "exp_avg_sq")), "only with quantize=None"),
    (lambda: px.StreamingDiLoCo(quantize=px.SparseLoCo(), moments=("exp_avg_sq",)), "only with quantize=None"),
    (lambda: px.StreamingDiLoCo(cut="layers"), "expected 'tensors' or 'values'"),
    (lambda: px.StreamingDiLoCo(cut="values", moments=("momentum",)), "moments= only with cut='tensors'"),
    (lambda: px.Quantize(bits=2), "4 or 8"),
    (lambda: px.Quantize(block=63), "even block"),
    (lambda: px.Quantize(rounding="up"), "'nearest' or 'stochastic'"),
])
def test_bad_arguments_get_one_line(make, says):
    with pytest.raises(px.ConfigError, match=None) as err:
        make()
    assert says in str(err.value) and "\n" not in str(err.value)


def test_more_fragments_than_parameters_is_refused_at_wrap():
    net = torch.nn.Linear(2, 1)  # two tensors
    with pytest.raises(px.ConfigError) as err:
        px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=px.StreamingDiLoCo(every=4, fragments=3))
    assert "fragments <= 2" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("opt, says", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), "momentum=0"),
    (lambda ps: torch.optim.Adagrad(ps, lr=0.1), "momentum=None"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), None),
])
def test_moments_the_optimizer_does_not_keep_are_refused_at_wrap(opt, says):
    net = torch.nn.Linear(2, 1)
    strategy = px.StreamingDiLoCo(every=4, fragments=2, moments=("momentum",))
    if says is None:  # SGD with momentum keeps its buffer: "momentum" names it
        px.wrap(net, opt(net.parameters()), strategy=strategy)
        assert strategy.moments.keys == ("momentum_buffer",)
        return
    with pytest.raises(px.ConfigError) as err:
        px.wrap(net, opt(net.parameters()), strategy=strategy)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_quantising_an_integer_buffer_is_refused():
    with pytest.raises(px.ConfigError) as err:
        px.Quantize(8).compress(torch.arange(10))
    assert "torch.int64" in str(err.value) and "\n" not in str(err.value)


# -- the fragment split -----------------------------------------------------------------------------------------------
def test_fragments_are_consecutive_nonempty_and_balanced_by_bytes():
    sizes = [100, 1, 1, 50, 50, 1, 97]
    parts = balanced_split(sizes, 3)
    assert [list(r) for r in parts] == [[0], [1, 2, 3, 4], [5, 6]]
    assert [len(r) for r in balanced_split([5] * 4, 4)] == [1, 1, 1, 1]


@pytest.mark.parametrize("sizes, parts", [([100, 1, 1, 50, 50, 1, 97], 3), ([760, 120, 120, 4], 8), ([7], 7),
                                          ([3, 3, 3], 2), ([1000, 1], 4)])
def test_a_cut_by_values_is_consecutive_and_equal_to_one_value(sizes, parts):
    split = value_split(sizes, parts)
    flat = [(p.tensor, v) for f in split for p in f for v in range(p.start, p.stop)]
    assert flat == [(i, v) for i, n in enumerate(sizes) for v in range(n)]  # every value once, in order
    per = [sum(p.stop - p.start for p in f) for f in split]
    assert max(per) - min(per) <= 1 and min(per) > 0


def test_a_cut_never_splits_a_tensor_that_cannot_be_viewed_flat():
    split = value_split([10, 30, 20], 2, whole={1})  # the middle (30) falls inside tensor 1: moved to its end (40)
    assert [[(p.tensor, p.start, p.stop) for p in f] for f in split] == [[(0, 0, 10), (1, 0, 30)], [(2, 0, 20)]]
    net = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    assert not net.weight.is_contiguous()
    with pytest.raises(px.ConfigError, match="not contiguous"):  # 3 parts of 112 values: the weight (108) is whole
        px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1),
                strategy=px.StreamingDiLoCo(every=3, fragments=3, cut="values"))


def test_a_cut_inside_a_tensor_writes_the_parameter_through_a_view_and_finish_leaves_the_anchor():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 100), torch.nn.Linear(100, 1))  # 400 + 100 + 100 + 1 values
    s = px.StreamingDiLoCo(every=4, fragments=4, cut="values")
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=s)
    assert [f.numel for f in s.fragments] == [150, 151, 150, 150]  # 601 values: the first weight is cut in three
    x = torch.randn(8, 4)
    for _ in range(6):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    s.finish()
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    assert torch.equal(flat, torch.cat([a.reshape(-1) for f in s.fragments for a in f.anchor]))
    assert "cut='values'" in repr(s)


def test_a_sharded_model_refuses_fragments_cut_by_values():
    assert px.StreamingDiLoCo(every=4).on_shards()
    assert not px.StreamingDiLoCo(every=4, cut="values").on_shards()


# -- the quantiser --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4, 5), (130,)])
def test_round_trip_stays_within_half_a_level_per_block(bits, shape):
    q = px.Quantize(bits, block=16)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    payload, ctx = q.compress(x)
    back = q.decompress(payload, ctx)
    assert back.shape == x.shape and back.dtype == x.dtype
    flat, err = x.reshape(-1), (back - x).reshape(-1).abs()
    levels = 2 ** (bits - 1) - 1
    for start in range(0, flat.numel(), 16):  # per block: half a level of that block's own scale
        block = flat[start:start + 16]
        assert err[start:start + 16].max() <= block.abs().max() / levels / 2 * (1 + 1e-6) + 1e-12
    assert payload.numel() == q.message_bytes(max(1, x.numel()))


def test_four_bits_travel_two_to_a_byte():
    q = px.Quantize(4, block=128)
    assert q.message_bytes(1024) == 1024 // 2 + 4 * 8 + 4  # values, 8 float32 scales, the weight
    assert px.Quantize(8, block=128).message_bytes(1024) == 1024 + 4 * 8 + 4


def test_stochastic_rounding_is_unbiased_and_within_one_level():
    q = px.Quantize(4, block=8, rounding="stochastic", seed=1)
    x = torch.linspace(-1, 1, 8)
    backs = torch.stack([q.decompress(*q.compress(x)) for _ in range(500)])
    assert (backs - x).abs().max() <= 1 / 7 + 1e-6
    assert (backs.mean(0) - x).abs().max() < 0.015  # the mean's standard error is at most 0.0032 here


def test_error_feedback_keeps_what_rounding_left_out():
    q = px.Quantize(4, block=4, error_feedback=True)
    x = torch.tensor([1.0, 0.3, -0.2, 0.05])
    sent = q.decompress(*q.compress(x, "k"))
    torch.testing.assert_close(sent + q.residuals["k"], x)


def test_one_process_streaming_with_one_fragment_and_no_overlap_is_diloco():
    def run(strategy):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        model, opt = px.wrap(net, torch.optim.AdamW(net.parameters(), lr=0.01), strategy=strategy)
        g = torch.Generator().manual_seed(1)
        for _ in range(11):
            opt.zero_grad()
            F.mse_loss(model(torch.randn(5, 4, generator=g)), torch.randn(5, 2, generator=g)).backward()
            opt.step()
        strategy.finish()
        return [p.detach().clone() for p in net.parameters()]

    diloco = run(px.DiLoCo(every=3))
    for mixing in (None, "eager"):  # eager with nothing to overlap: the stand-in is replaced at once, exactly
        for a, b in zip(diloco, run(px.StreamingDiLoCo(every=3, fragments=1, overlap=0, mixing=mixing)), strict=True):
            assert torch.equal(a, b), mixing


@pytest.mark.parametrize("make", [lambda: px.DiLoCo(every=3),
                                  lambda: px.StreamingDiLoCo(every=3, fragments=2, overlap=1)], ids=["diloco", "sd"])
def test_finish_after_a_partial_round_is_the_replicas_mean_not_an_outer_step(make):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    strategy = make()
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=strategy)
    g = torch.Generator().manual_seed(1)
    for _ in range(11):  # 2 local steps since the last round: a Nesterov step would move them
        opt.zero_grad()
        F.mse_loss(model(torch.randn(5, 4, generator=g)), torch.randn(5, 2, generator=g)).backward()
        opt.step()
    before = [p.detach().clone() for p in net.parameters()]
    strategy.finish()
    for a, b in zip(net.parameters(), before, strict=True):  # the mean of one replica is that replica
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=1e-7)


def test_the_registered_name_wraps_and_trains_in_a_group_of_one():
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05), strategy="streaming-diloco")
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(torch.ones(3, 4)), torch.zeros(3, 2)).backward()
        opt.step()
    got = px.strategy_of(opt)
    assert isinstance(got, px.StreamingDiLoCo) and got.steps == 3 and got.bytes_sent == 0
    got.finish()
    assert all(torch.equal(a, p) for f in got.fragments for a, p in zip(f.anchor, f.params, strict=True))


# -- two workers ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("streaming-ckpt")
    return run_workers("workers.streaming:exchanges", world_size=2, timeout=300, steps=STEPS,
                       ckpt_dir=str(ckpt)).results


def paper_oracle(steps: int, every: int, fragments: int, overlap: int, alpha: float | str,
                 inner_momentum: float = 0.0, moments: bool = False, cut: str = "tensors") -> dict:
    """Algorithm 1 of arXiv 2501.18512 for 2 workers, in ONE process: plain SGD inner steps, Nesterov outer.

    ``alpha="eager"``: arXiv 2502.12996's eager update instead of the mix. At the send each worker takes the
    outer step with its own pseudo-gradient (on a copy of the momentum); when the average lands the worker
    keeps what it did since, on the new anchor. ``inner_momentum``: SGD with momentum inside; ``moments``:
    each fragment's momentum buffers averaged with it (``moments=("momentum",)``): at the landing, ``overlap``
    steps after the send, each worker's buffer gains ``momentum**overlap * (mean sent - its own sent)``.
    ``cut="values"``: the two fragments are the first and second half of the concatenated values, whatever tensor
    the middle falls in."""
    from phalanx.bench.models import digits_cnn, load_digits_split
    from workers.streaming import BATCH

    train_set, _ = load_digits_split()
    torch.manual_seed(0)
    replicas = [digits_cnn(), digits_cnn()]
    replicas[1].load_state_dict(replicas[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=inner_momentum) for m in replicas]
    loaders = [px.shard(train_set, batch_size=BATCH, seed=0, rank=r, world_size=2) for r in range(2)]
    assert fragments == 2
    sizes = [p.numel() for p in replicas[0].parameters()]
    if cut == "tensors":  # consecutive parameters, one cut where the bytes before it come closest to half
        at = min(range(1, len(sizes)), key=lambda c: abs(sum(sizes[:c]) - sum(sizes) / 2))
        cuts = [0, sum(sizes[:at]), sum(sizes)]
    else:  # the middle value, rounded half up
        cuts = [0, (sum(sizes) + 1) // 2, sum(sizes)]
    # every update below is elementwise: each "parameter" of the rule is one flat run of values of one tensor
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    runs = [(i, max(lo, starts[i]) - starts[i], min(hi, starts[i + 1]) - starts[i])
            for lo, hi in zip(cuts, cuts[1:]) for i in range(len(sizes)) if max(lo, starts[i]) < min(hi, starts[i + 1])]
    frags = [[k for k, (i, a, b) in enumerate(runs) if cuts[f] <= starts[i] + a < cuts[f + 1]] for f in range(2)]
    offsets = [p * every // fragments for p in range(fragments)]
    whole = [list(m.parameters()) for m in replicas]
    params = [[w[i] if (a, b) == (0, sizes[i]) else w[i].detach().view(-1)[a:b] for i, a, b in runs] for w in whole]
    anchor = [p.detach().clone() for p in params[0]]
    momentum = [torch.zeros_like(a) for a in anchor]
    in_flight: dict[int, tuple[int, list[torch.Tensor]]] = {}
    stand_in: dict[tuple[int, int], torch.Tensor] = {}  # (worker, parameter) -> its weights after the eager step
    buffers_sent: dict[int, list[list[torch.Tensor]]] = {}  # fragment -> per worker, its momentum buffers as sent
    for t in lockstep(replicas, opts, loaders):
        with torch.no_grad():
            for p, idx in enumerate(frags):
                if t % every == offsets[p]:  # the outer gradient, averaged over the workers, starts travelling
                    in_flight[p] = (t, [sum(anchor[i] - w[i] for w in params) / 2 for i in idx])
                    if moments:
                        assert cut == "tensors"  # whole tensors: one run each, optimizer state per tensor
                        buffers_sent[p] = [[o.state[w[runs[i][0]]]["momentum_buffer"].clone() for i in idx]
                                           for o, w in zip(opts, whole, strict=True)]
                    if alpha == "eager":
                        for r, w in enumerate(params):
                            for i in idx:
                                d = anchor[i] - w[i]
                                stand_in[r, i] = anchor[i] - 0.7 * (d + 0.9 * (0.9 * momentum[i] + d))
                                w[i].copy_(stand_in[r, i])
            for p, idx in enumerate(frags):
                if p in in_flight and t == in_flight[p][0] + overlap:  # it lands: outer Nesterov, then mix
                    sent = buffers_sent.pop(p, None)
                    for j, i in enumerate(idx if sent is not None else ()):
                        mean = (sent[0][j] + sent[1][j]) / 2
                        for r, (o, w) in enumerate(zip(opts, whole, strict=True)):
                            o.state[w[runs[i][0]]]["momentum_buffer"] += (inner_momentum ** overlap
                                                                           * (mean - sent[r][j]))
                    for i, d in zip(idx, in_flight.pop(p)[1], strict=True):
                        momentum[i] = 0.9 * momentum[i] + d
                        anchor[i] -= 0.7 * (d + 0.9 * momentum[i])
                        for r, w in enumerate(params):
                            if alpha == "eager":
                                w[i].copy_(anchor[i] + (w[i] - stand_in.pop((r, i))))
                            else:
                                w[i].copy_(alpha * w[i] + (1 - alpha) * anchor[i])
        if t == steps:
            break
    return {"replicas": [[p.detach().clone() for p in ps] for ps in whole], "anchor": anchor,
            "layout": [len(f) for f in frags], "cuts": cuts}


def assert_follows(results: list[dict], name: str, oracle: dict) -> None:
    """Every rank's replica before finish() (``results[rank][name]``) and the anchors (``name + "_anchor"``) equal
    the one-process oracle's to 1e-6."""
    for rank, got in enumerate(results):
        for a, b in zip(got[name]["before_finish"], oracle["replicas"][rank], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        for a, b in zip(got[f"{name}_anchor"], oracle["anchor"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def gap(one: dict, other: dict) -> float:
    """How far two oracles' rank-0 replicas end apart: a rule that matters moves them."""
    return max(float((a - b).abs().max()) for a, b in zip(one["replicas"][0], other["replicas"][0], strict=True))


@pytest.mark.multiproc
def test_one_fragment_without_overlap_is_diloco_bit_for_bit(results):
    for rank in results:
        for key in ("before_finish", "params"):
            for a, b in zip(rank["diloco"][key], rank["streaming1"][key], strict=True):
                assert torch.equal(a, b)
        assert rank["diloco"]["bytes_per_step"] == rank["streaming1"]["bytes_per_step"]


@pytest.mark.multiproc
def test_finish_leaves_every_rank_on_the_mean_of_the_replicas(results):
    r0, r1 = results  # 8 steps of DiLoCo(every=3): two local steps after the last round
    for key in ("diloco", "streaming1"):
        for a, b, mine, theirs in zip(r0[key]["params"], r1[key]["params"], r0[key]["before_finish"],
                                      r1[key]["before_finish"], strict=True):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, (mine + theirs) / 2, rtol=0, atol=1e-6)


@pytest.mark.multiproc
def test_two_fragments_overlapped_by_one_step_follow_the_papers_algorithm(results):
    oracle = paper_oracle(STEPS, every=4, fragments=2, overlap=1, alpha=0.5)
    assert all(got["paper_layout"] == oracle["layout"] for got in results)
    assert_follows(results, "paper", oracle)


@pytest.mark.multiproc
def test_fragments_cut_by_values_follow_the_papers_algorithm_on_the_halves_of_the_values(results):
    oracle = paper_oracle(STEPS, every=4, fragments=2, overlap=1, alpha=0.5, cut="values")
    by_tensors = paper_oracle(STEPS, every=4, fragments=2, overlap=1, alpha=0.5)
    assert oracle["cuts"] != by_tensors["cuts"]  # the middle falls inside a tensor: a fragment holds part of it
    assert all(got["values_sizes"] == [oracle["cuts"][1], oracle["cuts"][2] - oracle["cuts"][1]] for got in results)
    assert_follows(results, "values", oracle)
    assert gap(oracle, by_tensors) > 1e-4  # the cut matters: the replicas are not those of whole-tensor fragments


@pytest.mark.multiproc
def test_eager_updates_follow_the_eager_papers_rule_computed_in_one_process(results):
    oracle = paper_oracle(STEPS, every=4, fragments=2, overlap=1, alpha="eager")
    mixed = paper_oracle(STEPS, every=4, fragments=2, overlap=1, alpha=0.5)
    assert_follows(results, "eager", oracle)
    assert gap(oracle, mixed) > 1e-3  # the rule matters: the replicas are not the mixing rule's


@pytest.mark.multiproc
def test_momentum_averaged_with_each_fragment_follows_the_rule_computed_in_one_process(results):
    oracle = paper_oracle(STEPS, every=4, fragments=2, overlap=1, alpha=0.5, inner_momentum=0.9, moments=True)
    assert_follows(results, "moments", oracle)
    # the averaged buffers matter: with each worker keeping its own momentum the replicas end elsewhere
    assert gap(oracle, paper_oracle(STEPS, every=4, fragments=2, overlap=1, alpha=0.5, inner_momentum=0.9)) > 1e-4


@pytest.mark.multiproc
def test_a_checkpoint_with_an_exchange_in_flight_resumes_exactly(results):
    for rank in results:
        for name, pair in rank["resume"].items():
            for a, b in zip(pair["straight"], pair["resumed"], strict=True):
                assert torch.equal(a, b), name


@pytest.mark.multiproc
def test_quantised_exchanges_keep_replicas_in_step_and_send_fewer_bytes(results):
    r0, r1 = results
    for a, b in zip(r0["q4_anchor"], r1["q4_anchor"], strict=True):  # the dequantised sum is the same bits
        assert torch.equal(a, b)
    for a, b in zip(r0["q4"]["params"], r1["q4"]["params"], strict=True):  # finish() reconciles the replicas
        assert torch.equal(a, b)
    # 4 bits + a float32 scale per 128 values against 32 bits: about 7.5x fewer bytes than the float32 exchange
    assert r0["q4"]["bytes_per_step"] < r0["paper"]["bytes_per_step"] / 7
    # int8 gradients: close to the float32 average, and 4x fewer bytes (all-gather of 2 messages of n + n/16 bytes)
    for a, b in zip(r0["allreduce_int8"]["params"], r0["allreduce"]["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)
    assert r0["allreduce_int8"]["bytes_per_step"] < r0["allreduce"]["bytes_per_step"] / 3
    assert all(math.isfinite(float(p.sum())) for p in r0["diloco_int8"]["params"])


# -- elastic: a kill while an exchange is in flight, a spare joining mid-overlap ----------------------------------
WORKER = os.path.join(TESTS, "workers", "streaming.py")


def launch(tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``phalanx run -n 3 --elastic RUN_FLAGS -- SCRIPT_FLAGS`` on the streaming script; each worker's result."""
    cut = flags.index("--")
    cmd = ["run", "-n", "3", "--elastic", "--min-workers", "2", *flags[:cut], WORKER, "--out", str(tmp_path),
           *flags[cut + 1:]]
    proc = run_cli(cmd, str(tmp_path), 180)  # a fork of this process; its workers fork from one preloaded server
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}


def check_against_oracle(got: dict, mixing: float | str = 0.5, cut: str = "tensors") -> None:
    """Every worker's replica and anchors are the one-process replay's; finish() leaves them all equal."""
    some = got["0"]  # a member from the start: its history has every change (a joiner's begins at its join)
    full = [(h["joined"], h["step"]) for h in some["history"]]
    for r in got.values():
        mine = [(h["joined"], h["step"]) for h in r["history"]]
        assert r["record"] == some["record"] and mine == full[len(full) - len(mine):]
    oracle = streaming.elastic_oracle(some["record"], some["history"], mixing, cut)
    assert sorted(oracle["members"]) == sorted(got)
    for wid, r in got.items():
        assert r["rank"] == oracle["members"].index(wid)
        for a, b in zip(r["replica"], oracle["replicas"][wid], strict=True):
            torch.testing.assert_close(torch.tensor(a), b, rtol=1e-5, atol=1e-6)
        for a, b in zip(r["anchors"], oracle["anchors"], strict=True):
            torch.testing.assert_close(torch.tensor(a), b, rtol=1e-5, atol=1e-6)
        assert r["params"] == some["params"]


@pytest.mark.multiproc
@pytest.mark.parametrize("mixing, cut", [(0.5, "tensors"), ("eager", "tensors"), (0.5, "values")])
def test_a_kill_mid_overlap_drops_the_lost_workers_part_and_the_survivors_go_on(tmp_path, mixing, cut):
    _, got = launch(tmp_path, "--", "--kill", "2@4", "--commit-every", "3", "--mixing", str(mixing), "--cut", cut)
    assert sorted(got) == ["0", "1"]
    for r in got.values():
        assert r["world_size"] == 2 and [h["left"] for h in r["history"]] == [["2"]]
    # Worker 2 dies before step 4: the survivors roll back to the commit of step 3, which held fragment 1's
    # exchange (sent at step 2) in flight; the two send their parts of it again, worker 2's is dropped.
    assert got["0"]["history"][0]["step"] == 3 and got["0"]["in_flight"]["3"] == [1]
    check_against_oracle(got, mixing, cut)  # eager: each survivor's stand-in came back with its commit


@pytest.mark.multiproc
@pytest.mark.parametrize("mixing", [0.5, "eager"])
def test_a_spare_joining_mid_overlap_gets_the_fragments_outer_state(tmp_path, mixing):
    # Commits at steps 3, 6, 9; worker 1 dies before step 10. By then both fragments have taken outer steps
    # (anchors moved, momentum non-zero) and fragment 0's exchange of step 8 is in flight at the commit of
    # step 9. The survivors roll back to it and the spare s0 enters as rank 2: it must take the anchors and
    # outer momentum and send an empty part for the exchange in flight, or its replica and anchors leave the
    # oracle's (and the others').
    proc, got = launch(tmp_path, "--spares", "1", "--", "--kill", "1@10", "--commit-every", "3", "--mixing",
                       str(mixing))
    assert sorted(got) == ["0", "2", "s0"] and "spare s0" in proc.stderr
    [change] = got["0"]["history"]
    assert (change["left"], change["joined"], change["step"]) == (["1"], ["s0"], 9)
    assert got["0"]["in_flight"]["9"] == [0] and got["s0"]["in_flight"]["9"] == [0]
    assert all(r["world_size"] == 3 for r in got.values())
    check_against_oracle(got, mixing)  # eager: the spare holds no stand-in, so it takes the anchor when it lands
