"""Core, on 2 real worker processes talking gloo, each checked against a one-process oracle.

Worker runs are few and do several checks each: starting processes is the expensive part.
"""
from __future__ import annotations

import pytest
import torch

import phalanx as px
from phalanx.group.liveness import CONFIRM_S
from support.procs import run_workers
from workers.core import OPTIMIZERS, dataset, net, train

pytestmark = pytest.mark.multiproc

BATCH, EPOCHS = 4, 2  # 2 workers x 4 = global batch 8: 6 steps per epoch on 48 samples


def relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)


@pytest.fixture(scope="module")
def equivalence_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("eq") / "model.pt"
    run = run_workers("workers.core:equivalence", world_size=2, batch=BATCH, epochs=EPOCHS, save_path=str(path))
    return run.results, path


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_workers_equal_one_process_with_twice_the_batch(equivalence_run, optimizer):
    results, _ = equivalence_run
    oracle = net(seed=0)
    oracle.load_state_dict(results[0][f"{optimizer}_init"])  # rank 0's initial weights, which px.wrap broadcast
    opt = OPTIMIZERS[optimizer](oracle.parameters())
    train(oracle, opt, px.shard(dataset(), batch_size=2 * BATCH, seed=7, rank=0, world_size=1), EPOCHS)
    for rank in (0, 1):
        assert relative_error(results[rank][f"{optimizer}_final"], oracle.state_dict()) < 1e-5


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_initial_weights_come_from_rank_0_and_replicas_agree_after_every_step(equivalence_run, optimizer):
    results, _ = equivalence_run
    for r in results:
        assert r[f"{optimizer}_init_differs"]  # the workers' seeds really differed ...
        assert r[f"{optimizer}_init_is_rank0"]  # ... and px.wrap gave everyone rank 0's weights
        assert r[f"{optimizer}_agree"] == [True] * (EPOCHS * 6)  # bit-identical after each of the 12 steps


def test_px_save_of_a_wrapped_model_loads_into_the_plain_class(equivalence_run):
    results, path = equivalence_run
    plain = net(seed=3)
    plain.load_state_dict(torch.load(path, weights_only=True))  # strict: no "module." prefixes
    assert relative_error(plain.state_dict(), results[0]["adam_final"]) == 0


def test_wrap_before_init_in_a_two_worker_run_is_refused_clearly(equivalence_run):
    results, _ = equivalence_run
    msg = results[1]["wrap_before_init"]
    assert "2-worker run before px.init()" in msg and "expected" in msg and "\n" not in msg


def test_sync_batchnorm_on_cpu_workers_is_refused_clearly(equivalence_run):
    results, _ = equivalence_run
    assert results[0]["sync_bn_on_cpu"].startswith("nn.SyncBatchNorm on CPU workers; expected GPU workers")


def test_resume_in_new_processes_equals_the_uninterrupted_run(tmp_path):
    ckpt = str(tmp_path / "ckpt.pt")
    # 3 epochs of 6 steps with shuffling and dropout; the checkpoint is taken at step 7, inside epoch 1.
    whole = run_workers("workers.core:resume", world_size=2, ckpt=ckpt, phase="first").results
    resumed = run_workers("workers.core:resume", world_size=2, ckpt=ckpt, phase="second").results
    for rank in (0, 1):
        assert int(resumed[rank]["step"]) == int(whole[rank]["step"]) == 18
        torch.testing.assert_close(resumed[rank]["weights"], whole[rank]["weights"], rtol=1e-6, atol=1e-7)


def test_a_dead_worker_makes_the_survivor_fail_fast_naming_it():
    timeout = 10
    run = run_workers("workers.core:lost_worker", world_size=2, check=False, timeout=60,
                      env={"PHALANX_TIMEOUT": str(timeout)})
    assert run.returncodes[1] == 3  # killed by kill_at(3, rank=1, ...)
    assert run.returncodes[0] == 0, run.log(0)
    seen = run.results[0]
    # Inside training (the default strategy's backward pass), the survivor fails at once instead of hanging,
    # with an error that names the lost rank.
    assert seen["train"]["seconds"] < timeout, seen
    assert seen["train"]["type"] == "WorkerLostError", seen
    assert "lost contact with rank(s) 1" in seen["train"]["message"]
    # A phalanx collective raises WorkerLostError that names the lost rank, within the bound.
    assert seen["barrier"]["type"] == "WorkerLostError", seen
    assert "lost contact with rank(s) 1" in seen["barrier"]["message"]
    assert seen["barrier"]["seconds"] < timeout
    # Leaving, it does not wait to see rank 1 fall silent (a fresh watch needs CONFIRM_S for that, twice: the exit
    # barrier's meeting, then the store host's lingering): it already found rank 1 lost.
    assert seen["shutdown_s"] < CONFIRM_S, seen["shutdown_s"]
