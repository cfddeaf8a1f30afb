"""Parameter-server strategies with real worker processes and real server processes.

Budgets (digits CNN, 2 workers × batch 32, SGD lr 0.05 momentum 0.9 on the workers):
Downpour with server-side Adagrad (Dean et al. 2012) on 2 server processes, and
asynchronous EASGD (τ = 4) on colocated servers, each get 8 epochs and must reach a
test accuracy of at least 0.93.
"""
from __future__ import annotations

import threading

import pytest
import torch

from phalanx.ps import start_servers
from phalanx.testing import run_workers

pytestmark = pytest.mark.multiproc

EPOCHS = 8
COLOCATED = {"PHALANX_PS_ADDRS": ""}  # whatever the shell exported: each worker hosts a shard server


@pytest.mark.parametrize("strategy, opts, servers", [("downpour", {"adagrad_lr": 0.02}, 2),
                                                     ("easgd-async", {"every": 4}, "colocated")])
def test_asynchronous_strategies_reach_093_on_digits_with_2_workers(strategy, opts, servers):
    if servers == "colocated":  # one shard server in each worker process
        run = run_workers("workers.ps:train", world_size=2, env=COLOCATED, strategy=strategy, opts=opts,
                          epochs=EPOCHS, lr=0.05, momentum=0.9)
    else:
        with start_servers(servers) as group:
            run = run_workers("workers.ps:train", world_size=2, env=group.env(), strategy=strategy, opts=opts,
                              epochs=EPOCHS, lr=0.05, momentum=0.9)
    accs = [r["acc"] for r in run.results]
    load = run.results[0]["load"]
    print(f"{strategy}: test accuracy per worker's final pull {accs}; per-server requests {load['requests']}, "
          f"bytes imbalance {load['bytes_imbalance']:.3f}")
    assert min(accs) >= 0.93
    assert load["bytes_imbalance"] <= 1.1 and min(load["requests"]) > 0  # both servers carried their share


def test_synchronous_ps_gives_the_same_weights_as_allreduce():
    run = run_workers("workers.ps:sync_vs_allreduce", world_size=2, env=COLOCATED, steps=6, lr=0.05, momentum=0.9)
    for rank in (0, 1):
        ps, ar = run.results[rank]["ps-sync"], run.results[rank]["allreduce"]
        assert max((a - b).abs().max().item() for a, b in zip(ps, ar, strict=True)) <= 1e-5
    assert all(torch.equal(a, b) for a, b in zip(run.results[0]["ps-sync"], run.results[1]["ps-sync"], strict=True))


def test_killing_one_of_3_downpour_workers_leaves_the_others_to_finish_a_valid_model():
    with start_servers(1) as servers:
        run = run_workers("workers.ps:train", world_size=3, env=servers.env(), check=False, strategy="downpour",
                          opts={"adagrad_lr": 0.02}, epochs=6, lr=0.05, momentum=0.9, kill={"rank": 1, "step": 5})
        alive = servers.alive()
    assert run.returncodes == [0, 1, 0], run.logs
    assert run.results[1] is None  # killed at step 5
    for rank in (0, 2):
        result = run.results[rank]
        assert result["finite"] and result["acc"] >= 0.9, result["acc"]
    assert alive == [True]  # the server never noticed


def test_a_worker_that_joins_a_running_job_receives_the_current_parameters():
    with start_servers(1) as servers:
        job: dict = {}
        running = threading.Thread(target=lambda: job.update(run=run_workers(
            "workers.ps:train", world_size=2, env=servers.env(), strategy="downpour",
            opts={"adagrad_lr": 0.02}, epochs=4, lr=0.05, momentum=0.9)))
        running.start()
        late = run_workers("workers.ps:late_join", world_size=1, env=servers.env(), after_versions=40).results[0]
        running.join()
    assert "run" in job
    assert min(late["versions"].values()) >= 40  # it pulled what the job had made of the model
    # not its own initial weights
    assert not any(torch.equal(a, b) for a, b in zip(late["own"], late["joined"], strict=True))
    assert late["acc_joined"] > 0.5  # a trained model, not a fresh one
    assert all(late["after"][k] > late["versions"][k] for k in late["versions"])  # and then it contributed
