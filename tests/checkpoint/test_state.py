"""The state protocol: resume, per-rank RNG, exact validation, uneven last batches, save placement, kill -9.

Multi-process parts run on 2 real gloo workers (tests/workers/state.py) in two groups (and a third, the slow
peer's, beside them), checked against the uninterrupted run or a one-process oracle computed here.
"""
from __future__ import annotations

import glob
import os
import signal
import socket
import threading
import time
from multiprocessing import forkserver
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from workers import state as W

import phalanx as px
from phalanx.framing import read_verified, write_verified
from support.procs import run_workers
from phalanx.train.trainer import Trainer
from support.wait import until


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("state"))


@pytest.fixture(scope="module")
def runs(state_dir: str) -> tuple[list[dict], list[dict]]:
    tmp = state_dir
    # The slow-peer save (rank 1 idles 11 s, the slowness under test) runs in a group of its own beside ``first``
    # and ``second`` (one after the other, in this thread): its wait overlaps their work. It starts once the fork
    # server runs: the server's start swaps os.environ (under a lock), which a second thread's run_workers would
    # read half-swapped.
    slow: dict[str, Any] = {}
    beside = threading.Thread(target=lambda: slow.update(run=run_workers(
        "workers.state:slow_peer", world_size=2, timeout=180, check=False, tmp=os.path.join(tmp, "slow"))))
    os.makedirs(os.path.join(tmp, "slow"), exist_ok=True)
    started = threading.Thread(target=lambda: slow.update(first=run_workers(
        "workers.state:first", world_size=2, timeout=180, check=False, tmp=tmp)))
    started.start()
    until(lambda: getattr(forkserver._forkserver, "_forkserver_pid", None) is not None or not started.is_alive(),
          timeout=180, what="the fork server")
    beside.start()
    try:
        started.join()
        assert "first" in slow, "the first run's run_workers raised (its traceback is above)"
        assert not any(slow["first"].returncodes), f"first: workers failed {slow['first'].returncodes}\n" + \
            "\n".join(log[-3000:] for log in slow["first"].logs)
        second = run_workers("workers.state:second", world_size=2, timeout=180, tmp=tmp).results
    finally:
        beside.join()
    assert "run" in slow, "the slow peer's run_workers raised (its traceback is above)"
    run = slow["run"]
    assert not any(run.returncodes), f"slow peer: workers failed {run.returncodes}\n" + "\n".join(
        log[-3000:] for log in run.logs)
    first = slow["first"].results
    for rank in (0, 1):
        second[rank]["slow_peer"] = run.results[rank]["slow_peer"]
    return first, second


# -- resume ---------------------------------------------------------------------------------------------------------
@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", list(W.STRATEGIES))
def test_resume_in_new_processes_equals_the_uninterrupted_run_for_every_rank(runs, strategy):
    first, second = runs
    for rank in (0, 1):
        whole, resumed = first[rank]["resume"][strategy], second[rank]["resume"][strategy]
        assert whole["steps"] == resumed["steps"] == W.EPOCHS * 6
        torch.testing.assert_close(resumed["weights"], whole["weights"], rtol=1e-6, atol=1e-6)


@pytest.mark.multiproc
def test_every_ranks_python_numpy_and_torch_rng_streams_continue_after_resume(runs):
    first, second = runs
    for strategy in W.STRATEGIES:
        draws = [first[rank]["resume"][strategy]["rng"] for rank in (0, 1)]
        assert draws[0] != draws[1]  # the ranks' streams really differ, so rank 0's on both would be caught
        for rank in (0, 1):
            assert second[rank]["resume"][strategy]["rng"] == draws[rank], (strategy, rank)


@pytest.mark.multiproc
def test_a_checkpoint_of_2_workers_resumes_1_from_rank_0_with_the_epoch_re_split(runs, state_dir):
    path = os.path.join(state_dir, "allreduce.pt")
    saved = px.read_checkpoint(path)["ranks"][0]
    model = W.net(seed=77)
    model, opt = px.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), strategy=px.AllReduce())
    loader = px.shard(W.dataset(), batch_size=W.BATCH, seed=11)  # now 1 worker x 4 per step
    with pytest.warns(UserWarning, match="taken with 2 workers and this run has 1"):
        assert px.load_checkpoint(path, model, opt, loader=loader)["step"] == W.SAVE_AT
    assert all(torch.equal(v, saved["model"][k]) for k, v in model.state_dict().items())
    assert loader.state_dict() == {"epoch": 1, "seed": 11, "samples": 8, "n": W.N_TRAIN}  # 1 step of 2 x 4 done
    assert loader.steps_left() == 10
    assert sum(len(y) for _, y in loader) == W.N_TRAIN - 8  # the other 40 samples of the epoch, 4 per step


# -- validation -----------------------------------------------------------------------------------------------------
@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["ignore_index", "class_weights"])
def test_validation_of_padded_and_weighted_losses_equals_one_process(runs, case):
    first, _ = runs
    loss_fn = nn.CrossEntropyLoss(ignore_index=W.IGNORE) if case == "ignore_index" else \
        nn.CrossEntropyLoss(weight=torch.tensor(W.CLASS_WEIGHTS))
    data = W.dataset(101, seed=2, padded=case == "ignore_index")
    model = W.net(seed=10)
    oracle = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, metrics=["accuracy"])
    expected = oracle.evaluate(data, batch_size=16)
    x, y = data.tensors
    with torch.no_grad():
        whole = loss_fn(model(x), y).item()  # torch's own reduction over the whole set, in one call
    assert expected["loss"] == pytest.approx(whole, rel=1e-6)
    for rank in (0, 1):
        assert first[rank]["validation"][case] == expected


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["batchnorm", "local"])
def test_validation_evaluates_rank_0s_model_the_one_px_save_writes(runs, case):
    first, _ = runs
    run = [first[rank]["validation"][case] for rank in (0, 1)]
    differs = [k for k, v in run[0]["states"][0].items() if v.is_floating_point() and
               not torch.equal(v, run[1]["states"][0][k])]
    assert differs  # after epoch 1 the replicas differ (BatchNorm statistics; LocalSGD between syncs)
    for epoch, state in enumerate(run[0]["states"]):
        model = W.net(seed=0, batchnorm=case == "batchnorm")
        model.load_state_dict(state)
        oracle = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, metrics=["accuracy"])
        expected = oracle.evaluate(W.dataset(101, seed=2), batch_size=16)
        for rank in (0, 1):
            row = run[rank]["history"][epoch]
            assert row["epoch"] == epoch + 1
            assert (row["val_loss"], row["val_accuracy"]) == (expected["loss"], expected["accuracy"]), (epoch, rank)


def test_a_loss_whose_mean_cannot_be_combined_is_refused_at_construction():
    model = W.net(seed=0)
    with pytest.raises(px.ConfigError, match="CTC") as err:
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CTCLoss())
    assert "\n" not in str(err.value)


# -- the short last batch -------------------------------------------------------------------------------------------
@pytest.mark.multiproc
def test_short_last_batch_takes_one_process_step_count_and_an_empty_part_survives(runs):
    _, second = runs
    expected = {21: [[4, 4, 3], [4, 4, 2]], 17: [[4, 4, 1], [4, 4, 0]]}  # one process with batch 8: 3 steps each
    for n, sizes in expected.items():
        for rank in (0, 1):
            assert second[rank]["uneven"][n]["sizes"] == sizes[rank]
            assert torch.isfinite(second[rank]["uneven"][n]["weights"]).all()


@pytest.mark.multiproc
@pytest.mark.parametrize("n", [21, 17])
def test_short_last_batch_gradient_equals_one_process_on_the_same_samples(runs, n):
    _, second = runs
    oracle = W.net(seed=30)
    opt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    for x, y in px.shard(W.dataset(n, seed=4), batch_size=2 * W.BATCH, seed=6, rank=0, world_size=1):
        opt.zero_grad()
        F.cross_entropy(oracle(x), y).backward()
        opt.step()
    for rank in (0, 1):
        torch.testing.assert_close(second[rank]["uneven"][n]["weights"], W.flat(oracle), rtol=1e-6, atol=1e-6)


# -- where a port puts its save -------------------------------------------------------------------------------------
@pytest.mark.multiproc
def test_save_checkpoint_under_if_rank_0_fails_within_seconds_saying_why(runs):
    first, _ = runs
    seen = first[0]["rank0_only"]
    assert seen["seconds"] < 2.0 + 3.0, seen  # the wait (2 s in this test) and little more, not the timeout
    assert seen["error"].startswith("ConfigError: px.save_checkpoint is collective but rank(s) 1 did not call it")
    assert "not under `if rank == 0:`" in seen["error"] and "\n" not in seen["error"]
    assert not seen["written"]


@pytest.mark.multiproc
def test_a_peer_that_comes_to_the_save_late_is_waited_for_not_taken_for_a_call_on_some_workers(runs):
    _, second = runs
    for rank in (0, 1):
        assert second[rank]["slow_peer"] == {"error": None, "written": True}, second[rank]["slow_peer"]


@pytest.mark.multiproc
def test_a_full_disk_on_rank_0_raises_on_every_rank_naming_the_path(runs):
    first, _ = runs
    for rank in (0, 1):
        seen = first[rank]["disk_full"]
        assert seen["error"] is not None and seen["error"].startswith("CheckpointError:"), seen
        assert seen["path"] in seen["error"] and "File too large" in seen["error"], seen
        assert not seen["exists"]
    assert first[1]["disk_full"]["error"].startswith("CheckpointError: rank 0 could not write the checkpoint")


# -- kill -9 during saves -------------------------------------------------------------------------------------------
SAVER = """
import sys, torch
from phalanx.framing import write_verified
body = {"w": torch.randn(2_000_000)}
while True:
    write_verified(sys.argv[1], body)
"""


def kill_during_saves(path: str, trials: int, seed: int = 0) -> list[int]:
    """kill -9 a process that saves ``path`` in a loop, ``trials`` times; the temporaries left after each kill.

    The saver is forked from the fork server that imported torch once (``start_worker("forkserver")``, as the
    module's worker runs are): its own process, killed for real, without a fresh interpreter's torch import each
    trial.
    """
    import random
    from phalanx.launch.workers import start_worker
    rng = random.Random(seed)
    left = []
    for _ in range(trials):
        proc = start_worker("forkserver", ["-c", SAVER, path], dict(os.environ))
        mid_write = os.path.join(os.path.dirname(path), f".*.tmp-*-{proc.pid}-*")
        until(lambda m=mid_write: glob.glob(m), timeout=30, what="the saver's first write", procs=[proc])
        time.sleep(rng.uniform(0.0, 0.3))  # sleep: a random instant to kill at is the trial (not a wait)
        until(lambda m=mid_write: glob.glob(m), timeout=10, what="the saver's write", procs=[proc])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        left.append(len(glob.glob(os.path.join(os.path.dirname(path), ".*.tmp-*"))))
    return left


def test_kill_9_during_saves_leaves_at_most_one_temporary_and_the_next_save_removes_it(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    left = kill_during_saves(path, trials=3)
    assert max(left) <= 1 and 1 in left, left  # a kill mid-write leaves one; the next writer removes it
    if os.path.exists(path):
        read_verified(path)  # whatever the kill interrupted, the file is whole
    write_verified(path, {"step": 1})
    assert glob.glob(str(tmp_path / ".*.tmp-*")) == [] and read_verified(path) == {"step": 1}


def test_a_live_writers_temporary_is_left_alone(tmp_path):
    live = tmp_path / f".ckpt.pt.tmp-{socket.gethostname()}-{os.getppid()}-abc"  # our parent: alive
    live.write_bytes(b"in progress")
    dead = tmp_path / f".ckpt.pt.tmp-{socket.gethostname()}-999999999-abc"  # no such process
    dead.write_bytes(b"abandoned")
    write_verified(tmp_path / "ckpt.pt", {"step": 2})
    assert live.exists() and not dead.exists()


def test_training_loss_of_a_padded_loss_is_torchs_mean_over_the_kept_targets():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, W.IN, generator=gen), torch.randint(0, W.CLASSES, (64,), generator=gen)
    y[::3] = W.IGNORE  # batches of 10 hold different numbers of real targets
    model, loss_fn = W.net(seed=0), nn.CrossEntropyLoss(ignore_index=W.IGNORE)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn)  # lr 0: the model stays put
    history = t.fit(torch.utils.data.TensorDataset(x, y), epochs=1, batch_size=10, shuffle=False, progress=False)
    with torch.no_grad():
        assert history[0]["loss"] == pytest.approx(loss_fn(model(x), y).item(), rel=1e-6)


def test_restoring_an_in_memory_capture_replays_the_same_steps_scheduler_scaler_and_rng_included():
    from phalanx.checkpoint.training_state import TrainingState
    model = W.net(seed=3, dropout=0.3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    loader = px.shard(W.dataset(), batch_size=8, seed=2)
    state = TrainingState(model, opt, loader=loader, scheduler=scheduler, scaler=scaler, extra={"note": "x"})

    def steps(n: int) -> list[float]:
        it, seen = iter(loader), []
        for _ in range(n):
            x, y = next(it)
            opt.zero_grad()
            scaler.scale(F.cross_entropy(model(x + torch.randn_like(x)), y)).backward()
            scaler.step(opt)
            scaler.update()
            scheduler.step()
            seen.append(W.flat(model).sum().item() + opt.param_groups[0]["lr"] + scaler.get_scale())
        return seen

    steps(2)
    snapshot = state.capture()
    first = steps(3)
    state.restore(snapshot)
    assert steps(3) == first and state.extra == {"note": "x"}  # bit for bit: weights, moments, lr, scale, data, RNG


@pytest.mark.parametrize("case", ["no ranks", "ranks not a list", "a rank not a dict", "world_size disagrees",
                                  "rank 0 points to itself", "a marker for a part rank 0 lacks"])
def test_a_checkpoint_with_valid_framing_but_the_wrong_structure_is_one_clear_checkpoint_error(tmp_path, case):
    import warnings

    from phalanx.checkpoint import FORMAT, SAME_AS_RANK0
    from phalanx.errors import CheckpointError
    from phalanx.checkpoint.training_state import TrainingState
    model = W.net(seed=0)
    path = str(tmp_path / "ckpt.pt")  # a one-file checkpoint of the earlier format (still loaded)
    rank0 = TrainingState(model).capture()
    body = {"format": FORMAT, "world_size": 1, "step": 0, "extra": {}, "ranks": [rank0]}
    body.update({"no ranks": {"ranks": []}, "ranks not a list": {"ranks": {"0": rank0}},
                 "a rank not a dict": {"ranks": [rank0, 7], "world_size": 2},
                 "world_size disagrees": {"world_size": 3},
                 "rank 0 points to itself": {"ranks": [{**rank0, "model": SAME_AS_RANK0}]},
                 "a marker for a part rank 0 lacks": {"ranks": [rank0, {**rank0, "nope": SAME_AS_RANK0}],
                                                      "world_size": 2}}[case])
    assert body["format"] == FORMAT
    write_verified(path, body)  # the framing is valid and its hash recomputed: only the structure is wrong
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "taken with 0 workers" warning before the error
        with pytest.raises(CheckpointError) as err:
            px.load_checkpoint(path, W.net(seed=1))
    assert path in str(err.value) and "structure" in str(err.value) and "\n" not in str(err.value)
