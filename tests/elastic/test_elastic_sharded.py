"""Elastic training with sharded state: ``phalanx run --elastic`` with ``shard=px.FullyShard(group_size=2)``.

4 workers = 2 replica groups x 2 shards (HSDP) train ``tests/workers/elastic.py``; the worker
started as rank 1 (shard 1 of group 0) is killed with SIGKILL. The 3 survivors rebuild the
group, take the lost shard from the surviving replica group and re-shard the model and the
optimizer onto themselves (1 x 3: 2 does not divide 3); the replacement that ``--replace``
starts then joins and receives its shards (2 x 2 again). With one replica group (1 x 2) the
lost shard exists nowhere in memory: the survivor reloads the checkpoint every commit wrote.
Each result equals one process trained on the same global batches (the oracle of
tests/elastic/test_elastic.py). A joiner receives only the rows of its own shards (about 1/S of the
model and optimizer state), point to point; and on 2 live processes without the launcher,
``phalanx.sharding.reshard.reshard`` moves exactly the rows each worker lacks (1 x 2 -> 2 x 1 -> 1 x 2).
"""
from __future__ import annotations

import glob
import json
from typing import Any

import pytest
import torch

import phalanx as px

from support.procs import shared_run
from support.forked_launch import launch  # the launcher forked from this process, its workers from one server
from workers import elastic as worker
from workers import sharded_reshard


def _2x2_loses_rank_1_then_a_replacement_joins(tmp_path_factory, name: str, *flags: str, timeout: float) -> tuple:
    """The 2 x 2 job the fixtures run: rank 1 killed at step 5, commits every 3, --replace's joiner after the
    regroup; ``flags`` are the worker's own (the rule, epochs, how the survivors wait for the joiner)."""
    tmp_path = tmp_path_factory.mktemp(name)
    # --start-method: a module fixture runs before the suite's per-test PHALANX_START_METHOD=forkserver
    # (tests/conftest.py), so it says so itself; forking the 4 workers and the replacement from one server that
    # imported torch saves about 3 s of CPU each, and --replacement-after-regroup orders the loss's regroup before
    # the join however soon the replacement is ready.
    proc, results = launch(tmp_path, "--min-workers", "3", "--replace", "--start-method", "forkserver", "--",
                           "--shard", "2", "--kill", "1@5",
                           "--commit-every", "3", "--replacement-after-regroup", *flags, n=4, timeout=timeout)
    return tmp_path, proc, results


def _periodic_2x2(strategy: str):
    """A module fixture: the 2 x 2 job under a periodic rule with plain inner SGD (its oracle needs no optimizer
    state), the survivors waiting (bounded) for the replacement."""
    @pytest.fixture(scope="module")
    def job(tmp_path_factory) -> tuple:
        return _2x2_loses_rank_1_then_a_replacement_joins(tmp_path_factory, strategy, "--strategy", strategy,
                                                          "--plain-sgd", "--epochs", "3", "--wait-for-replacement",
                                                          "4", timeout=420)
    return job


def _went_2x2_1x3_2x2_and_equals(job: tuple, oracle, rtol: float = 0.0) -> None:
    """The job lost rank 1 (2 x 2 -> 1 x 3), then took its replacement r1 (2 x 2), and every worker holds its replica
    group's weights in ``oracle(record)`` (one list of tensors per replica group)."""
    _, proc, results = job
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(results) == ["0", "2", "3", "r1"]
    record = results["0"]["record"]
    worlds = [w for _, w, _ in record]
    assert 3 in worlds and worlds[0] == 4 and worlds[-1] == 4, worlds  # 2 x 2, then 1 x 3, then 2 x 2 again
    want = oracle(record)
    for r in results.values():
        assert [(h["left"], h["joined"]) for h in r["history"]][-1][1] == ["r1"]
        for got, expected in zip(r["params"], want[r["rank"] // 2], strict=True):  # its replica group's weights
            torch.testing.assert_close(torch.tensor(got), expected, rtol=rtol, atol=1e-6)


@pytest.fixture(scope="module")
def hsdp_2x2_loses_a_worker_then_a_replacement_joins(tmp_path_factory) -> tuple:
    # --wait-for-replacement: the survivors wait (bounded) for the replacement to ask and to be ready, however long
    # its start-up takes (over 30 s at a load of 60 on 2 cores)
    # --kill-in-step: rank 1 dies after the step's gather, so the others meet its loss inside FSDP's own collectives
    # (test_a_worker_lost_inside_fsdps_own_collectives_is_a_lost_peer reads this job too)
    return _2x2_loses_rank_1_then_a_replacement_joins(tmp_path_factory, "hsdp", "--epochs", "4", "--kill-in-step",
                                                      "--wait-for-replacement", "4", timeout=420)


@pytest.mark.multiproc
def test_hsdp_2x2_loses_a_worker_goes_on_as_1x3_then_a_replacement_joins_as_2x2_equal_to_the_oracle(
        hsdp_2x2_loses_a_worker_then_a_replacement_joins):
    tmp_path, proc, results = hsdp_2x2_loses_a_worker_then_a_replacement_joins
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(results) == ["0", "2", "3", "r1"]
    assert "3 workers re-shard as 1 x 3" in proc.stderr
    for wid in ("0", "2", "3"):  # the same processes went on
        assert len(glob.glob(str(tmp_path / f"start{wid}-*.json"))) == 1
        assert [(h["left"], h["joined"]) for h in results[wid]["history"]] == [(["1"], []), ([], ["r1"])]
    record = results["0"]["record"]
    assert all(r["record"] == record and r["world_size"] == 4 for r in results.values())
    worlds = [w for _, w, _ in record]
    joined = worlds.index(4, 3)
    assert worlds[:4] == [4, 4, 4, 3] and set(worlds[3:joined]) == {3} and set(worlds[joined:]) == {4}
    for epoch in range(4):  # every sample once per epoch: rolled back at the loss, nothing redone at the join
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    for r in results.values():  # the oracle: one process on the same global batches
        for got, want in zip(r["params"], worker.oracle(record), strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


def diloco_oracle(record: list, group_size: int, every: int = 2, outer_lr: float = 0.7,
                  momentum: float = 0.9, compressor: Any = None) -> list[list[torch.Tensor]]:
    """DiLoCo on unsharded replicas, replayed in one process: at each recorded step of world size W the replicas
    are the replica groups of the layout (W / S of them, or one of all W when S does not divide W), each an inner
    SGD step on the mean of its workers' batch-mean gradients (rank order, px.shard's split: FSDP averages the
    workers of a replica group, so a short last batch of 2, 1, 1 samples weighs its workers equally); every
    ``every`` steps the outer Nesterov step on the replicas' mean pseudo-gradient. ``compressor``: a factory of
    DiLoCo's compressor (``px.SparseLoCo``): each rank of the layout compresses its rows of the pseudo-gradient
    (one flat vector, the parameters' rows in order) with its own residuals, the ranks of one shard index average
    their messages, and every residual starts empty at each regroup (the rule a sharded regroup follows).
    Returns each replica group's weights at the end (the worker script calls no finish(), so a partial last round
    leaves them apart)."""
    from phalanx.data.sampler import split_sizes

    net, data = worker.model(), worker.dataset()
    anchor = [p.detach().clone() for p in net.parameters()]
    buffers = [torch.zeros_like(a) for a in anchor]
    replicas: list[list[torch.Tensor]] = []
    ranks_of: list[list[Any]] = []  # each rank's compressor, [group][shard], laid out anew at each regroup
    before = 0
    for step, (_epoch, world, ids) in enumerate(record, start=1):
        groups = world // group_size if world % group_size == 0 else 1
        if world != before and compressor is not None:
            ranks_of, before = [[compressor() for _ in range(world // groups)] for _ in range(groups)], world
        if len(replicas) != groups:
            assert all(torch.equal(r, a) for rep in replicas for r, a in zip(rep, anchor)), "a layout changed " \
                "between two rounds"
            replicas = [[a.clone() for a in anchor] for _ in range(groups)]
        sizes = split_sizes(len(ids), [1.0] * world)
        per_rank = [sum(sizes[:r]) for r in range(world + 1)]
        ranks = world // groups
        for j, rep in enumerate(replicas):
            grads = [torch.zeros_like(v) for v in rep]
            for r in range(j * ranks, (j + 1) * ranks):  # FSDP's mean over the replica group's workers
                x, y = data[torch.tensor(ids[per_rank[r]:per_rank[r + 1]])][:2]
                for p, value in zip(net.parameters(), rep):
                    p.data.copy_(value)
                net.zero_grad()
                torch.nn.functional.mse_loss(net(x), y).backward()
                for grad, p in zip(grads, net.parameters()):
                    grad.add_(p.grad, alpha=1 / ranks)
            for value, grad in zip(rep, grads):
                value.sub_(grad, alpha=worker.PLAIN_LR)
        if step % every == 0:
            means = [a - torch.stack([rep[i] for rep in replicas]).mean(0) for i, a in enumerate(anchor)]
            if compressor is not None:
                means = _compressed_means(anchor, replicas, ranks_of)
            for a, buf, d in zip(anchor, buffers, means):
                buf.mul_(momentum).add_(d)
                a.sub_(d + momentum * buf, alpha=outer_lr)
            replicas = [[a.clone() for a in anchor] for _ in replicas]
    return replicas


def _compressed_means(anchor: list[torch.Tensor], replicas: list[list[torch.Tensor]],
                      ranks_of: list[list[Any]]) -> list[torch.Tensor]:
    """The pseudo-gradient DiLoCo's compressor leaves on every rank of a sharded layout: for each shard index, its
    ranks' messages (their rows of ``anchor - replica``, flat, with their own residuals) averaged in rank order."""
    from phalanx.sharding.reshard import _rows

    size = len(ranks_of[0])
    out = [torch.zeros_like(a) for a in anchor]
    for s in range(size):
        rows = [_rows(a.shape[0], size, s) for a in anchor]
        flats = [torch.cat([(a - rep[i])[lo:hi].reshape(-1) for i, (a, (lo, hi)) in enumerate(zip(anchor, rows))])
                 for rep in replicas]
        messages = [ranks_of[g][s].encode(flat, "pseudo") for g, flat in enumerate(flats)]
        mean, at = ranks_of[0][s].sum_messages(messages, flats[0].numel()), 0
        for o, (lo, hi) in zip(out, rows):
            n = (hi - lo) * (o[0].numel() if o.dim() > 1 else 1)
            o[lo:hi] = mean[at:at + n].view_as(o[lo:hi])
            at += n
    return out


diloco_2x2_loses_a_worker_then_a_replacement_joins = _periodic_2x2("diloco")


@pytest.mark.multiproc
def test_sharded_diloco_2x2_to_1x3_to_2x2_equals_diloco_on_unsharded_replicas(
        diloco_2x2_loses_a_worker_then_a_replacement_joins):
    # issue 39 item 4: the anchor and the outer momentum are shards of their own; a regroup moves their rows
    _went_2x2_1x3_2x2_and_equals(diloco_2x2_loses_a_worker_then_a_replacement_joins,
                                 lambda record: diloco_oracle(record, group_size=2), rtol=1e-5)


def _patched(replicas: list[list[torch.Tensor]], before: int, world: int, groups: int,
             lost: int | None) -> list[list[torch.Tensor]]:
    """The replica groups after a regroup from ``before`` to ``world`` workers, row by row as
    :func:`phalanx.sharding.reshard.reshard` moves a drifting replica: the survivors keep their order (``lost``
    left), joiners come last; each new rank keeps the rows of its new shard it held (its old replica group's) and
    takes the others from the lowest surviving rank that held them."""
    from phalanx.sharding.reshard import _rows

    old_size, new_size = before // len(replicas), world // groups
    olds = [r for r in range(before) if r != lost]
    alive = set(olds)
    out = [[torch.empty_like(t) for t in replicas[0]] for _ in range(groups)]
    for n in range(world):
        o = olds[n] if n < len(olds) else None  # a joiner held nothing
        for i, t in enumerate(replicas[0]):
            lo, hi = _rows(t.shape[0], new_size, n % new_size)
            for row in range(lo, hi):
                held = next(s for s in range(old_size) if _rows(t.shape[0], old_size, s)[0] <= row
                            < _rows(t.shape[0], old_size, s)[1])
                mine = o is not None and o % old_size == held
                source = o if mine else min(r for r in alive if r % old_size == held)
                out[n // new_size][i][row] = replicas[source // old_size][i][row]
    return out


def streaming_oracle(record: list, group_size: int, lost: int, every: int = 2, fragments: int = 2, overlap: int = 1,
                     mixing: float = 0.5, outer_lr: float = 0.7, momentum: float = 0.9,
                     trace: list | None = None) -> list[list[torch.Tensor]]:
    """StreamingDiLoCo on unsharded replicas, replayed in one process (one replica per replica group, inner steps as
    :func:`diloco_oracle`), with what a sharded regroup does to the replicas, which drift apart between exchanges:
    each row of each new replica comes from the lowest surviving old rank holding its old shard (FSDP2's chunks
    of dim 0; ``lost``: the old rank killed at the first shrink), as :func:`phalanx.sharding.reshard.reshard` moves
    them. An exchange sent before a commit has landed at it (its average, shared by every replica group) and is
    applied at its own step in the new layout. Returns each replica group's weights at the end (no finish())."""
    from phalanx.data.sampler import split_sizes
    from phalanx.strategies.fragments import balanced_split

    net, data = worker.model(), worker.dataset()
    params = list(net.parameters())
    split = balanced_split([p.numel() * p.element_size() for p in params], fragments)
    offsets = [i * every // fragments for i in range(fragments)]
    anchor = [p.detach().clone() for p in params]
    buffers = [torch.zeros_like(a) for a in anchor]
    sent_at, result = [-1] * fragments, [None] * fragments
    replicas = [[a.clone() for a in anchor]]
    before = record[0][1]
    for step, (_epoch, world, ids) in enumerate(record, start=1):
        groups = world // group_size if world % group_size == 0 else 1
        if world != before:  # a regroup: a rank keeps the rows it holds, the rest come from the lowest holder
            replicas = _patched(replicas, before, world, groups, lost if world < before else None)
            before = world
        elif len(replicas) != groups:
            replicas = [[r.clone() for r in replicas[0]] for _ in range(groups)]
        if trace is not None:  # each replica group's weights before the step, for a diagnosis
            trace.append([[t.clone() for t in rep] for rep in replicas])
        sizes = split_sizes(len(ids), [1.0] * world)
        per_rank = [sum(sizes[:r]) for r in range(world + 1)]
        ranks = world // groups
        for j, rep in enumerate(replicas):
            grads = [torch.zeros_like(v) for v in rep]
            for r in range(j * ranks, (j + 1) * ranks):  # FSDP's mean over the replica group's workers
                x, y = data[torch.tensor(ids[per_rank[r]:per_rank[r + 1]])][:2]
                for p, value in zip(params, rep):
                    p.data.copy_(value)
                net.zero_grad()
                torch.nn.functional.mse_loss(net(x), y).backward()
                for grad, p in zip(grads, params):
                    grad.add_(p.grad, alpha=1 / ranks)
            for value, grad in zip(rep, grads):
                value.sub_(grad, alpha=worker.PLAIN_LR)
        for f, idx in enumerate(split):  # the sends, then the exchanges that have travelled long enough
            if step % every == offsets[f]:
                sent_at[f] = step
                result[f] = {i: anchor[i] - torch.stack([rep[i] for rep in replicas]).mean(0) for i in idx}
        for f, idx in enumerate(split):
            if sent_at[f] >= 0 and step >= sent_at[f] + overlap:
                for i in idx:
                    d = result[f][i]
                    buffers[i].mul_(momentum).add_(d)
                    anchor[i].sub_(d + momentum * buffers[i], alpha=outer_lr)
                    for rep in replicas:
                        rep[i] = torch.lerp(anchor[i], rep[i], mixing)
                sent_at[f] = -1
    return replicas


streaming_2x2_loses_a_worker_then_a_replacement_joins = _periodic_2x2("streaming")


@pytest.mark.multiproc
def test_sharded_streaming_diloco_2x2_to_1x3_to_2x2_equals_streaming_diloco_on_unsharded_replicas(
        streaming_2x2_loses_a_worker_then_a_replacement_joins):
    # issue 39 item 4: the anchors, the outer momentum and the exchanges in flight (landed at each commit) are
    # rows a regroup moves with the model's; the replicas, apart between exchanges, are patched row by row
    _went_2x2_1x3_2x2_and_equals(streaming_2x2_loses_a_worker_then_a_replacement_joins,
                                 lambda record: streaming_oracle(record, group_size=2, lost=1))


sparseloco_2x2_loses_a_worker_then_a_replacement_joins = _periodic_2x2("diloco-sparseloco")


@pytest.mark.multiproc
def test_sharded_diloco_with_sparseloco_2x2_to_1x3_to_2x2_drops_the_residuals_at_each_regroup(
        sparseloco_2x2_loses_a_worker_then_a_replacement_joins):
    # issue 39 item 4: a residual is one rank's flat vector over its old rows, cut into SparseLoCo's chunks of that
    # layout; a regroup starts every residual empty, and the oracle replays exactly that rule
    _went_2x2_1x3_2x2_and_equals(sparseloco_2x2_loses_a_worker_then_a_replacement_joins,
                                 lambda record: diloco_oracle(record, group_size=2, outer_lr=1.0, momentum=0.0,
                                                              compressor=lambda: px.SparseLoCo(topk=4, chunk=16)))


@pytest.mark.multiproc
def test_a_joiner_receives_its_shards_not_the_whole_state(hsdp_2x2_loses_a_worker_then_a_replacement_joins):
    _, proc, results = hsdp_2x2_loses_a_worker_then_a_replacement_joins
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the whole state: every parameter and its SGD momentum buffer, fp32
    whole = 2 * 4 * sum(p.numel() for p in worker.model().parameters())
    [entry] = results["r1"]["history"]  # the replacement's entry: 1 x 3 -> 2 x 2, it holds shard 0 or 1 of 2
    assert entry["joined"] == ["r1"] and entry["state_bytes"] == whole
    # its rows of each tensor (torch.chunk over 2: the 1-row output layer goes whole to shard 0), nothing else
    assert 0 < entry["received_bytes"] <= 0.6 * whole, (entry["received_bytes"], whole)
    for r in results.values():  # nobody receives more than a shard's rows in any regroup; rows held stay put
        for h in r["history"]:
            assert h["received_bytes"] <= 0.6 * whole, (r["id"], h)


@pytest.mark.multiproc
def test_fsdp_of_one_replica_group_loses_a_worker_and_the_survivor_reloads_the_checkpoint(tmp_path):
    # R = 1: the lost worker's shard exists nowhere in memory; every commit also wrote a DCP checkpoint
    proc, results = launch(tmp_path, "--min-workers", "1", "--", "--shard", "2", "--kill", "1@5", "--commit-every",
                           "3", "--epochs", "1", "--checkpoint", str(tmp_path / "ckpt"), n=2, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shard 1 of 2 of the commit died with its only holder; the model and optimizer of step 3 come from" \
        in proc.stderr
    assert sorted(results) == ["0"] and [h["left"] for h in results["0"]["history"]] == [["1"]]
    record = results["0"]["record"]
    worlds = [w for _, w, _ in record]
    assert worlds == [2] * 3 + [1] * (len(worlds) - 3)
    for got, want in zip(results["0"]["params"], worker.oracle(record), strict=True):
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


# both launcher-less scenarios on one pair of processes (one start-up): the re-layout, then the let-go
reshard_then_let_go = shared_run("workers.sharded_reshard:relayout_then_let_go", world_size=2, timeout=120,
                                 name="reshard_then_let_go")


@pytest.mark.multiproc
def test_reshard_moves_only_the_rows_a_worker_lacks_and_training_goes_on_equal_to_one_process(reshard_then_let_go):
    # tests/workers/sharded_reshard.py: 1 x 2 -> 2 x 1 -> 1 x 2 on 2 live processes, tied weights, uneven shards
    runs = [out["relayout"] for out in reshard_then_let_go]
    whole = runs[0]["to1"]["state_bytes"]  # the parameters and both Adam moments, fp32
    assert whole == 3 * 4 * sum(p.numel() for p in sharded_reshard.Odd().parameters())
    for out in runs:
        for size in (1, 2):
            assert out[f"to{size}"]["diff"] == 0 and out[f"to{size}"]["shard_size"] == size
            assert out[f"to{size}"]["tied"]
        assert out["to2"]["received_bytes"] == 0  # each rank held every row already: nothing is sent
        assert out["diff"] < 1e-5  # one more step on the new layout: equal to one process's 3 steps
    # to 2 x 1 each rank receives exactly the rows of the other shard: together, the whole state once
    assert all(0 < out["to1"]["received_bytes"] < whole for out in runs)
    assert sum(out["to1"]["received_bytes"] for out in runs) == whole


@pytest.mark.multiproc
def test_a_worker_lost_inside_fsdps_own_collectives_is_a_lost_peer(hsdp_2x2_loses_a_worker_then_a_replacement_joins):
    # --kill-in-step: rank 1 dies after the step's gather, so the others meet its loss in FSDP's all-gather of the
    # parameters (torch's collective, outside phalanx), where gloo raises a plain RuntimeError ("Connection closed
    # by peer"); the chaos soak's --shard 2 variant ended with exit 1 at its first kill there. Rank 2 is then blocked
    # in FSDP's all-reduce with rank 0 (the other replica group), which already left for the regroup: it fails at
    # once only if rank 0 let go of every reference to the generation's groups (FSDP's state, the DTensors' meshes,
    # DTensor's caches), whose sockets close only when they are freed; else it waits its whole collective timeout
    # and misses the quorum ("arrived after generation 1 closed without it"). The HSDP job's kill is this one (its
    # replacement joins afterwards); what the loss must leave is checked here.
    tmp_path, proc, results = hsdp_2x2_loses_a_worker_then_a_replacement_joins
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(results) == ["0", "2", "3", "r1"], sorted(results)
    for wid in ("0", "2", "3"):  # every survivor made the quorum of the loss: nobody else left
        assert [h["left"] for h in results[wid]["history"]] == [["1"], []]
    record = results["0"]["record"]
    for r in results.values():
        for got, want in zip(r["params"], worker.oracle(record), strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.multiproc
def test_a_worker_that_lets_go_of_its_layout_closes_its_sockets_at_once(reshard_then_let_go):
    # issue 36 (the chaos soak's --shard 2): a survivor leaving a generation must free every reference to its
    # groups, or a peer of the other replica group blocked in FSDP's all-reduce with it waits its whole timeout.
    # Without DTensor's mesh-keyed caches emptied (reshard._forget_meshes) rank 1 waits the full timeout here.
    runs = [out["let_go"] for out in reshard_then_let_go]
    assert runs[1]["failed"], runs[1]
    assert runs[0]["peer_failed_while_we_ran"] and runs[0]["meta"], runs[0]


@pytest.mark.multiproc
def test_one_replica_group_loses_a_member_inside_two_commits_in_a_row_and_goes_on_from_the_checkpoint(tmp_path):
    # issue 36 (the chaos soak's --shard 2, ShardLostError "holds step 28, no commit held here"): 2 x 2 loses worker 1
    # inside the commit of step 6, after the in-memory commit and before its checkpoint: the survivors go on as
    # 1 x 3 from that commit (the lost shard lives in the other replica group), but the disk still holds step 3.
    # Worker 2 then dies inside the commit of step 9: its shard exists only on disk, and the survivors hold the
    # commits of steps 6 and 9. The checkpoint must be of a commit they hold: the regroup that resumed step 6
    # writes it, and the second loss rolls back to step 6 from the disk.
    ckpt = tmp_path / "ckpt"
    proc, results = launch(tmp_path, "--min-workers", "1", "--", "--shard", "2", "--kill-in-commit", "1@6,2@9",
                           "--commit-every", "3", "--epochs", "3", "--checkpoint", str(ckpt), n=4, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.load(open(tmp_path / f"killed{w}.json"))["step"] for w in "12"] == [6, 9]
    assert sorted(results) == ["0", "3"]
    assert "the commit of step 6 resumed here was not on disk" in proc.stderr, proc.stderr[-3000:]
    assert "of the commit died with its only holder; the model and optimizer of step 6 come from" in proc.stderr
    for r in results.values():
        assert [h["left"] for h in r["history"]] == [["1"], ["2"]]
        assert [h["step"] for h in r["history"]] == [6, 6]  # the second loss rolled back to the checkpoint's step
    record = results["0"]["record"]
    assert results["3"]["record"] == record
    worlds = [w for _, w, _ in record]
    assert worlds == [4] * 6 + [2] * (len(worlds) - 6), worlds  # 1 x 3's steps 7-9 were rolled back
    for epoch in range(3):  # every sample once per epoch
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    for r in results.values():  # the oracle: one process on the same global batches
        for got, want in zip(r["params"], worker.oracle(record), strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
