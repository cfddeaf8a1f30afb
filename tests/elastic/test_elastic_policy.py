"""Elastic resize policies, every synchronous strategy through a crash, and a kill that no ring neighbour sees.

The jobs run ``tests/workers/elastic_policy.py`` under ``phalanx run --elastic`` with
real SIGKILLs. Each survivor records the sample ids the whole group trained on at
every step (rolled back with the state); the oracle retrains one process on exactly
those global batches.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx import ConfigError
from phalanx.data.loader import global_batches
from phalanx.train.epoch_report import step_postfix
from workers import elastic as base
from support.paths import TESTS
from support.forked_launch import run_cli

WORKER = os.path.join(TESTS, "workers", "elastic_policy.py")
CLI = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]


def launch(tmp_path, *worker_flags: str, n: int = 3, run_flags: tuple[str, ...] = ("--min-workers", "2"),
           timeout: float = 120) -> tuple[subprocess.CompletedProcess, dict]:
    argv = ["run", "-n", str(n), "--elastic", *run_flags, WORKER, "--out", str(tmp_path), *worker_flags]
    proc = run_cli(argv, str(tmp_path), timeout)  # the launcher forked from here, its workers from one server
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}
    return proc, results


def check_survived(tmp_path, proc, results, victim: str, n: int = 3, epochs: int = 2) -> list:
    """Exit 0, the same processes went on, one membership change, every sample exactly once per epoch."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    survivors = sorted({str(i) for i in range(n)} - {victim})
    assert sorted(results) == survivors
    for wid, r in results.items():
        starts = glob.glob(str(tmp_path / f"start{wid}-*.json"))
        assert [os.path.basename(s) for s in starts] == [f"start{wid}-{r['pid']}.json"]
        assert r["world_size"] == n - 1 and [h["left"] for h in r["history"]] == [[victim]]
    record = results[survivors[0]]["record"]
    assert all(r["record"] == record for r in results.values())
    for epoch in range(epochs):
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(base.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    return record


oracle = base.oracle  # one process on the same global batches


# -- unit: the policies, without processes ---------------------------------------------------------------------------

def test_a_kept_global_batch_is_split_as_evenly_as_possible_over_any_world_size():
    plan = global_batches(20, 3, 2, shuffle=False, seed=0, epoch=0, global_size=9)
    assert [[len(part) for part in parts] for parts in plan] == [[5, 4], [5, 4], [1, 1]]
    assert [i for parts in plan for part in parts for i in part] == list(range(20))


def test_keep_global_batch_re_splits_the_loader_and_weights_the_uneven_parts():
    data = torch.utils.data.TensorDataset(torch.arange(20.))
    loaders = [px.shard(data, batch_size=3, shuffle=False, rank=r, world_size=3) for r in range(3)]
    policy = px.elastic.KeepGlobalBatch()
    policy.start(loaders[0], world_size=3)
    assert policy.global_batch == 9 and policy.state_dict() == {"global_batch": 9}
    weights = []
    for rank in range(2):  # one worker left: the two others keep the global batch of 9, as 5 + 4
        loader = loaders[rank]
        loader.sampler.rank, loader.sampler.world_size = rank, 2
        policy.resized(loader, before=3, after=2)
        sizes = []
        for (x,) in loader:
            sizes.append(len(x))
            weights.append(loader.batch_weight)
        assert sizes == ([5, 5, 1] if rank == 0 else [4, 4, 1])
    assert weights == [5 * 2 / 9, 5 * 2 / 9, 1.0, 4 * 2 / 9, 4 * 2 / 9, 1.0]


def test_keep_worker_batch_offers_the_linear_lr_factor_to_its_callback():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
    seen = []
    policy = px.elastic.KeepWorkerBatch(on_resize=lambda r: (seen.append(r), px.elastic.rescale_lr(opt)(r)))
    policy.resized(None, before=3, after=2)
    assert seen == [px.elastic.Resize(before=3, after=2, lr_factor=2 / 3)]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)
    policy.resized(None, before=2, after=2)  # no change in size: no call
    assert len(seen) == 1


def test_bad_resize_policies_are_refused_with_one_clear_line():
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="KeepGlobalBatch"):
        px.elastic.State(net, opt, resize="global")
    with pytest.raises(ConfigError, match="global_batch=0"):
        px.elastic.KeepGlobalBatch(global_batch=0)
    state = px.elastic.State(net, opt, [torch.ones(2)], resize=px.elastic.KeepGlobalBatch())
    with pytest.raises(ConfigError, match="px.shard loader"):
        state.commit()  # said at the first commit, not after a crash


def test_releasing_a_group_drops_the_defaults_torch_bound_to_it():
    import torch.distributed.nn.functional as fn

    from phalanx.elastic.rebuild import release
    group = object()
    saved = fn.broadcast.__defaults__
    fn.broadcast.__defaults__ = (group,)  # what importing the module after init_process_group leaves
    try:
        assert release(group) == 1 and fn.broadcast.__defaults__ == (None,)
    finally:
        fn.broadcast.__defaults__ = saved


def test_the_trainer_shows_the_world_size_on_its_progress_line_and_takes_a_policy(capsys):
    # Outside `phalanx run --elastic` an elastic fit runs plainly: one worker, shown as such.
    net = base.model()
    trainer = px.Trainer(net, base.optimizer(net), F.mse_loss)
    data = torch.utils.data.TensorDataset(*base.dataset().tensors[:2])
    history = trainer.fit(data, epochs=1, batch_size=16, elastic=2, resize=px.elastic.KeepGlobalBatch())
    assert "workers=1" in capsys.readouterr().out  # the plain line (stdout is no terminal here)
    assert history["world_size"] == [1] and history.membership == []
    assert step_postfix(0.5, None, 3) == {"loss": "0.5000", "workers": "3"}
    with pytest.raises(ConfigError, match="without elastic"):
        trainer.fit(data, epochs=1, resize=px.elastic.KeepGlobalBatch())


def test_the_regroup_line_tells_finished_steps_to_redo_from_the_seconds_of_work_lost(capsys):
    # A kill in the middle of the step after a commit loses that step's seconds but no finished step: the line once
    # read "redoing 0 step(s) (5.18s of work)", which contradicts itself.
    from types import SimpleNamespace
    from phalanx.elastic.commits import State
    state = SimpleNamespace(history=[], _moved={}, step=4)
    plan = {"generation": 1, "left": ["1"], "joined": []}
    State._note(state, plan, 3, 0.0, redone=0, cause="killed", redone_s=5.18)
    line = capsys.readouterr().err
    assert ("resuming from the commit at step 4: 0 finished step(s) to redo, 5.18s of work since that commit lost"
            in line)
    assert state.history[0]["redone_steps"] == 0 and state.history[0]["redone_seconds"] == 5.18


# -- real workers, real kills ----------------------------------------------------------------------------------------

@pytest.mark.multiproc
def test_keep_global_batch_kill_one_of_three_matches_one_process_on_the_same_global_batches(tmp_path):
    # 3 workers x batch 3: a global batch of 9; after the kill it is 5 + 4 on two workers, weighted.
    proc, results = launch(tmp_path, "--kill", "1@5", "--batch", "3", "--resize", "global")
    record = check_survived(tmp_path, proc, results, "1")
    sizes = [len(ids) for _, _, ids in record]
    assert sizes == [9] * 7 + [1] + [9] * 7 + [1]  # the same global batch before and after the kill
    assert [w for _, w, _ in record] == [3] * 3 + [2] * 13  # rolled back to the commit at step 3
    change = results["0"]["history"][0]
    assert (change["was"], change["world_size"], change["step"], change["redone_steps"]) == (3, 2, 3, 1)
    assert change["redone_seconds"] >= 0 and change["seconds"] >= 0
    assert "left: 1" in proc.stderr and "1 finished step(s) to redo" in proc.stderr
    want = oracle(record)
    for r in results.values():
        for got, expected in zip(r["params"], want, strict=True):
            torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.multiproc
# FP16 takes the same compressed-average path as PowerSGD, which also rolls back shared state (Q) and residuals;
# int8 sends its quantised buckets during backward, so the kill lands with exchanges in flight
@pytest.mark.parametrize("strategy", ["powersgd", "int8", "diloco", "easgd"])
def test_every_synchronous_strategy_survives_a_crash(tmp_path, strategy):
    proc, results = launch(tmp_path, "--kill", "2@4", "--strategy", strategy, "--epochs", "1")
    check_survived(tmp_path, proc, results, "2", epochs=1)
    assert results["0"]["params"] == results["1"]["params"]  # finish() leaves every replica equal


@pytest.mark.multiproc
def test_four_workers_a_kill_no_ring_neighbour_of_rank_0_sees_every_survivor_recovers_at_once(tmp_path):
    # Ring 0-1-2-3-0: rank 2's neighbours are 1 and 3; rank 0 talks to neither side of it, so it is the one
    # that could wait for a collective timeout (60 s) or the quorum timeout (heartbeat 20 s + 10 s here).
    # It did, until phalanx.elastic.rebuild.release dropped the references that kept the old group's sockets open.
    proc, results = launch(tmp_path, "--kill", "2@4", "--epochs", "1", n=4,
                           run_flags=("--min-workers", "3", "--heartbeat-timeout", "20"))
    record = check_survived(tmp_path, proc, results, "2", n=4, epochs=1)
    killed = json.load(open(tmp_path / "killed.json"))["time"]
    waits = {wid: r["first_step_after_recovery"] - killed for wid, r in results.items()}
    assert all(w < 10 for w in waits.values()), waits  # well under both timeouts, with room for a loaded machine
    want = oracle(record)
    for got, expected in zip(results["0"]["params"], want, strict=True):
        torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-5, atol=1e-6)
