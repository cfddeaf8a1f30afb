"""SparseLoCo (arXiv 2508.15706): chunked top-k of the pseudo-gradient plus residual, 2-bit values, error feedback.

Unit (one process): bad input, the message's bytes, what is sent plus the residual is the accumulator, the decay.
Two gloo workers under px.DiLoCo and px.StreamingDiLoCo, against the paper's algorithm written out below in ONE
process (both replicas simulated, AdamW inside); the residuals survive a checkpoint round trip exactly.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from support.procs import run_workers
from workers import sparseloco as w

pytestmark = pytest.mark.usefixtures("one_thread")


# -- one process ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, says", [
    (lambda: px.SparseLoCo(0), "topk"),
    (lambda: px.SparseLoCo(65, chunk=64), "topk <= chunk"),
    (lambda: px.SparseLoCo(chunk=0), "chunk"),
    (lambda: px.SparseLoCo(decay=1.5), "decay=1.5"),
])
def test_bad_arguments_get_one_line(make, says):
    with pytest.raises(px.ConfigError) as err:
        make()
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_message_is_the_documented_size_and_141x_smaller_than_float32_with_the_defaults():
    c = px.SparseLoCo()
    n = 10_000  # 3 chunks, the last one padded
    message = c.encode(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    chunks, kept = math.ceil(n / 4096), math.ceil(n / 4096) * 64
    assert message.numel() == c.message_bytes(n) == 4 * chunks + 4 + math.ceil(2 * kept / 8) + math.ceil(12 * kept / 8)
    assert c.message_bytes(4096 * 100) == 116 * 100 + 4 and 4 * 4096 * 100 / (116 * 100 + 4) > 141  # per chunk: 116


def test_what_is_sent_plus_the_residual_is_the_decayed_accumulator():
    c = px.SparseLoCo(3, chunk=16, decay=0.5)
    g = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(40, generator=g), torch.randn(40, generator=g)
    sent1 = c.decompress(*c.compress(x1, "k"))
    torch.testing.assert_close(sent1 + c.residuals["k"], x1)
    assert (sent1 != 0).sum() <= 3 * 3  # k per chunk, 3 chunks
    before = c.residuals["k"].clone()
    sent2 = c.decompress(*c.compress(x2, "k"))
    torch.testing.assert_close(sent2 + c.residuals["k"], 0.5 * before + x2)


def test_the_residuals_are_this_workers_own_state_and_reload_exactly():
    c = px.SparseLoCo(2, chunk=8)
    c.compress(torch.randn(20, generator=torch.Generator().manual_seed(2)), "k")
    assert c.state_dict() == {} and set(c.replica_state_dict()) == {"residuals"}
    d = px.SparseLoCo(2, chunk=8)
    d.load_replica_state_dict(c.replica_state_dict())
    x = torch.randn(20, generator=torch.Generator().manual_seed(3))
    assert torch.equal(c.encode(x, "k"), d.encode(x, "k")) and torch.equal(c.residuals["k"], d.residuals["k"])


def test_values_near_float32s_maximum_are_sent_finite():
    fmax = torch.finfo(torch.float32).max
    c = px.SparseLoCo(2, chunk=4)
    x = torch.tensor([fmax, -fmax, 1.0, 0.0])
    back = c.sum_messages([c.encode(x, "a"), c.encode(x, "b")], 4)
    assert torch.isfinite(back).all() and back[0] == fmax and back[1] == -fmax


def test_diloco_and_streaming_take_sparselocos_outer_defaults_and_keep_explicit_ones():
    d = px.DiLoCo(every=4, compression=px.SparseLoCo())
    assert (d.exchange.lr, d.exchange.momentum) == (1.0, 0.0)
    assert (px.DiLoCo(every=4).exchange.lr, px.DiLoCo(every=4).exchange.momentum) == (0.7, 0.9)
    assert px.DiLoCo(every=4, outer_lr=0.5, compression=px.SparseLoCo()).exchange.lr == 0.5
    s = px.StreamingDiLoCo(every=4, quantize=px.SparseLoCo())
    assert (s.outer_lr, s.outer_momentum) == (1.0, 0.0)


# -- two workers against the paper's algorithm ------------------------------------------------------------------------
def paper_oracle(fragments: list[tuple[list[int], int]]) -> list[list[list[torch.Tensor]]]:
    """SparseLoCo's Algorithm (arXiv 2508.15706) for 2 replicas in ONE process: each fragment's outer step at the
    steps ``t % H == offset``; per replica ``e = β e + Δ``; per chunk of the flat ``e`` the k largest magnitudes,
    each sent as the nearest of ``{-1, -1/3, 1/3, 1} x`` the chunk's largest kept magnitude; ``e -= sent``; the
    anchor moves by the mean of what was sent (outer lr 1, no momentum) and both replicas take it.
    Returns each replica's weights after each step."""
    replicas = [w.mlp(), w.mlp()]
    opts = [torch.optim.AdamW(m.parameters(), lr=w.LR) for m in replicas]
    params = [list(m.parameters()) for m in replicas]
    anchor = [p.detach().clone() for p in params[0]]
    acc: dict[tuple[int, int], torch.Tensor] = {}
    history: list[list[list[torch.Tensor]]] = [[], []]
    for t in range(1, w.STEPS + 1):
        for r in (0, 1):
            x, y = w.batch(r, t)
            opts[r].zero_grad()
            F.mse_loss(replicas[r](x), y).backward()
            opts[r].step()
        with torch.no_grad():
            for f, (idx, offset) in enumerate(fragments):
                if t % w.EVERY != offset:
                    continue
                sent = []
                for r in (0, 1):
                    delta = torch.cat([(anchor[i] - params[r][i]).reshape(-1) for i in idx])
                    e = delta if (r, f) not in acc else acc[r, f] * w.DECAY + delta
                    hat = torch.zeros_like(e)
                    for start in range(0, e.numel(), w.CHUNK):
                        piece = e[start:start + w.CHUNK]
                        top = piece.abs().topk(min(w.TOPK, piece.numel())).indices
                        levels = torch.tensor([-1.0, -1 / 3, 1 / 3, 1.0]) * piece[top].abs().max()
                        hat[start + top] = levels[(piece[top][:, None] - levels[None, :]).abs().argmin(dim=1)]
                    acc[r, f] = e - hat
                    sent.append(hat)
                mean, at = (sent[0] + sent[1]) / 2, 0
                for i in idx:
                    anchor[i] -= mean[at:at + anchor[i].numel()].view_as(anchor[i])
                    at += anchor[i].numel()
                    for r in (0, 1):
                        params[r][i].copy_(anchor[i])
        for r in (0, 1):
            history[r].append([p.detach().clone() for p in params[r]])
    return history


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers("workers.sparseloco:exchanges", world_size=2, timeout=240,
                       ckpt_dir=str(tmp_path_factory.mktemp("sparseloco-ckpt"))).results


@pytest.mark.multiproc
@pytest.mark.parametrize("rule", ["diloco", "streaming"])
def test_every_step_on_every_rank_follows_the_papers_algorithm_computed_in_one_process(results, rule):
    fragments = [(list(idx), int(offset)) for idx, offset in results[0][rule]["layout"]]
    assert len(fragments) == (1 if rule == "diloco" else 2)
    want = paper_oracle(fragments)
    for rank, res in enumerate(results):
        for step, (got, exp) in enumerate(zip(res[rule]["weights"], want[rank], strict=True), start=1):
            for a, b in zip(got, exp, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{rule}, rank {rank}, step {step}")
    # the replicas agree right after each fragment's outer step, and the residuals differ by rank (their own)
    assert not torch.equal(*(next(iter(r[rule]["residuals"].values())) for r in results))


@pytest.mark.multiproc
@pytest.mark.parametrize("rule", ["diloco", "streaming"])
def test_the_residuals_survive_a_checkpoint_round_trip_exactly(results, rule):
    for res in results:
        saved, loaded = res[rule]["resume"]["saved"], res[rule]["resume"]["loaded"]
        assert saved and set(saved) == set(loaded)
        for key in saved:
            assert torch.equal(saved[key], loaded[key])
        for a, b in zip(res[rule]["resume"]["final"], res[rule]["weights"][-1], strict=True):
            assert torch.equal(a, b)  # the resumed run ends where the uninterrupted one did, bit for bit


@pytest.mark.multiproc
def test_the_bytes_sent_are_the_sparse_messages(results):
    for res in results:
        rounds = w.STEPS // w.EVERY
        # DiLoCo: one message and the shares' sum (one float64) per round; Streaming: each fragment's message,
        # its weight inside, at its own steps (offsets 0 and 1 of 3)
        assert res["diloco"]["bytes_sent"] == rounds * (res["diloco"]["message_bytes"][0] + 8)
        sends = [sum(1 for t in range(1, w.STEPS + 1) if t % w.EVERY == off) for _, off in res["streaming"]["layout"]]
        assert res["streaming"]["bytes_sent"] == sum(n * b for n, b in zip(sends, res["streaming"]["message_bytes"],
                                                                          strict=True))
