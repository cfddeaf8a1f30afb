"""The CUDA path, run on a GPU: device prefetch, AMP under every strategy, two workers sharing one GPU over
gloo (against one process with the doubled batch), exact resume from a checkpoint written by GPU workers,
and a group of one on NCCL. Every test here skips cleanly on a machine without CUDA."""
from __future__ import annotations

import pytest
import torch

import phalanx as px
from phalanx.data.prefetch import prefetch
from support.procs import run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU (run benchmarks/gpu.sh there)")]

STRATEGIES = ["allreduce", "local-sgd", "diloco", "easgd", "fp16", "powersgd", "topk"]


def _batches(loader):
    return [tuple(t.clone() for t in b) for b in loader]


def test_prefetch_yields_the_same_batches_in_the_same_order_on_the_gpu():
    # batches of 6 MB: each copy takes long enough that reading a batch before its copy is done would show
    data = torch.utils.data.TensorDataset(torch.randn(227, 3, 128, 128), torch.arange(227))
    for epoch in (0, 1):
        plain = px.shard(data, batch_size=32, seed=5, rank=0, world_size=1)
        fetched = px.shard(data, batch_size=32, seed=5, rank=0, world_size=1, device="cuda")
        plain.set_epoch(epoch), fetched.set_epoch(epoch)
        ref = _batches(plain)
        got = []
        for x, y in fetched:
            assert x.is_cuda and y.is_cuda
            got.append((x.clone(), y.clone()))  # read at once on the consumer's stream, while the next copy runs
            (x @ x.transpose(-1, -2)).sum()  # and keep that stream busy
        assert len(got) == len(ref) == 8
        got = [(x.cpu(), y.cpu()) for x, y in got]
        for (x, y), (rx, ry) in zip(got, ref):
            assert torch.equal(x, rx) and torch.equal(y, ry)


def test_prefetch_position_counts_only_handed_out_batches():
    data = torch.utils.data.TensorDataset(torch.arange(40.0))
    loader = px.shard(data, batch_size=4, shuffle=False, rank=0, world_size=1, device="cuda")
    it = iter(loader)
    next(it), next(it)  # the prefetcher has already read the third batch
    assert loader.state_dict()["samples"] == 8  # 2 batches of 4, not the 3 read


def test_prefetch_wraps_any_loader_and_nested_batches():
    batches = [{"x": torch.full((2,), float(i)), "pair": (torch.tensor([i]), "label")} for i in range(5)]
    got = list(prefetch(batches, torch.device("cuda")))
    assert [int(b["pair"][0].item()) for b in got] == list(range(5))
    assert all(b["x"].is_cuda and b["pair"][1] == "label" for b in got)


@pytest.mark.multiproc
def test_amp_under_every_strategy_on_two_gpu_workers():
    res = run_workers("workers.gpu:amp_strategies", world_size=2, timeout=300, names=STRATEGIES,
                      amps=["bf16", "fp16"]).results
    for key in (f"{n}/{a}" for n in STRATEGIES for a in ("bf16", "fp16")):
        a, b = res[0][key], res[1][key]
        assert a["on"].startswith("cuda"), key
        assert all(torch.isfinite(torch.tensor(a["losses"]))), key
        assert torch.isfinite(a["params"]).all(), key
        # every rule ends with identical replicas: synchronous ones every step, the others at finish()
        assert torch.allclose(a["params"], b["params"], atol=1e-6), (key, (a["params"] - b["params"]).abs().max())
    # and training moved the weights: the loss fell from the first step to the last
    for key in ("allreduce/bf16", "allreduce/fp16"):
        assert res[0][key]["losses"][-1] < res[0][key]["losses"][0], key


@pytest.mark.multiproc
def test_two_processes_on_one_gpu_equal_one_process_with_twice_the_batch():
    two = run_workers("workers.gpu:two_on_one_gpu", world_size=2, timeout=180, batch=4, steps=6).results
    one = run_workers("workers.gpu:two_on_one_gpu", world_size=1, timeout=180, batch=8, steps=6).results
    assert two[0]["device"] == "cuda:0" and two[1]["device"] == "cuda:0"
    assert torch.equal(two[0]["params"], two[1]["params"])
    gap = (two[0]["params"] - one[0]["params"]).abs().max()
    assert torch.allclose(two[0]["params"], one[0]["params"], atol=1e-5), gap


@pytest.mark.multiproc
@pytest.mark.parametrize("per_rank", [
    False,
    True,  # every rank's CUDA RNG is in the checkpoint (TrainingState); not yet re-run on a GPU since that landed
])
def test_gpu_workers_resume_exactly_from_a_checkpoint(tmp_path, per_rank):
    path = str(tmp_path / "ckpt.pt")
    kw = {"batch": 4, "steps": 4, "dropout": 0.3, "cuda_seed_per_rank": per_rank, "adam": True}
    straight = run_workers("workers.gpu:two_on_one_gpu", world_size=2, timeout=180, path=path, **kw).results
    resumed = run_workers("workers.gpu:two_on_one_gpu", world_size=2, timeout=180, path=path, resume=True,
                          **kw).results
    for rank in (0, 1):
        assert torch.equal(straight[rank]["params"], resumed[rank]["params"]), rank


@pytest.mark.multiproc
def test_a_skipped_fp16_step_is_skipped_on_every_allreduce_worker():
    res = run_workers("workers.gpu:skipped_step", world_size=2, timeout=180, name="allreduce").results
    assert torch.equal(res[0]["params"], res[1]["params"])  # rank 1's overflow reached rank 0 through the average
    assert res[0]["scale"] == res[1]["scale"] < 65536.0  # both scalers saw the inf and backed off


def test_nccl_group_of_one():
    res = run_workers("workers.gpu:nccl_group_of_one", world_size=1, timeout=120).results[0]
    assert res["backend"] == "nccl" and res["cuda_all_reduce"].tolist() == [0.0, 1.0, 2.0, 3.0]
    # NCCL has no CPU tensors, and the checkpoint gathers CPU tensors (RNG states, pickled state): a
    # "cpu:gloo,cuda:nccl" group carries both
    assert res["cpu_all_gather"] != "ok"
    assert res["mixed_cpu_all_gather"] and res["mixed_cuda_all_reduce"].tolist() == [1.0, 1.0, 1.0]
