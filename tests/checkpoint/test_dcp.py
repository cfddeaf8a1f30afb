"""DCP checkpoints: save on 2 workers, resume on 3 and on 1 equal to one process; a model sharded with
torch's ``fully_shard`` on 2 x 2 loads unsharded and resharded (1 x 2, 1 x 3, 3 x 1); kill -9 during an
asynchronous save leaves the previous checkpoint; ``phalanx export``; bad input.
Real gloo processes (tests/workers/dcp.py), one-process oracles.
"""
from __future__ import annotations

import glob
import json
import os
import pickle
import time

import pytest
import torch
from workers import dcp as W

import phalanx as px
from phalanx.cli import main as cli
from phalanx.group.orphan import launcher_gone
from support.procs import run_workers
from support.wait import until


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    ckpt = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    return ckpt, run_workers("workers.dcp:train", world_size=2, timeout=120, ckpt=ckpt, resume=False).results


@pytest.mark.multiproc
def test_two_workers_saving_mid_epoch_equal_one_process(saved):
    ckpt, results = saved
    assert sorted(os.listdir(ckpt)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "phalanx.json", "rank-0.pt",
                                        "rank-1.pt"]  # each worker wrote its own part
    for r in results:
        torch.testing.assert_close(r["weights"], W.oracle(), rtol=1e-5, atol=1e-5)


@pytest.mark.multiproc
def test_a_checkpoint_of_2_workers_resumes_on_3_equal_to_the_uninterrupted_run(saved):
    ckpt, _ = saved
    results = run_workers("workers.dcp:train", world_size=3, timeout=120, ckpt=ckpt, resume=True).results
    for r in results:
        assert r["steps"] == W.STEPS
        torch.testing.assert_close(r["at_load"], W.oracle(W.SAVE_AT), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["weights"], W.oracle(), rtol=1e-5, atol=1e-5)


@pytest.mark.multiproc
def test_a_checkpoint_of_2_workers_resumes_on_1_equal_to_the_uninterrupted_run(saved):
    ckpt, _ = saved
    model, opt = W._wrapped(99)
    loader = px.shard(W.dataset(), batch_size=W.GLOBAL_BATCH, seed=7)
    with pytest.warns(UserWarning, match="taken with 2 workers and this run has 1"):
        step = px.load_checkpoint(ckpt, model, opt, loader=loader)["step"]
    assert step == W.SAVE_AT
    assert W.loop(model, opt, loader, step, W.STEPS) == W.STEPS
    torch.testing.assert_close(W.flat(model), W.oracle(), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def hsdp_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    """A checkpoint written at SAVE_AT by 4 workers sharded 2 x 2 (HSDP), asynchronously: each worker's writer
    process writes the shards it staged."""
    ckpt = str(tmp_path_factory.mktemp("hsdp") / "sharded")
    return ckpt, run_workers("workers.dcp:sharded", world_size=4, timeout=180, ckpt=ckpt, mesh=[2, 2],
                             load=False, asynchronous=True).results


@pytest.mark.multiproc
def test_a_2x2_hsdp_checkpoint_loads_unsharded_on_1_and_sharded_on_1x2_equal_to_one_process(hsdp_saved):
    ckpt, saved = hsdp_saved
    assert saved[0]["shards"]["0.weight"] == W.HIDDEN * W.IN // 2  # each worker held half of each parameter
    assert [f for f in saved[0]["files"] if f.endswith(".distcp")] == [f"__{r}_0.distcp" for r in range(4)]
    torch.testing.assert_close(saved[0]["full"], W.oracle(W.SAVE_AT), rtol=1e-5, atol=1e-5)  # HSDP = one process

    model = W.net(seed=99)  # 2 x 2 -> 1: plain, unsharded, in this process
    opt = W.optimizer(model)
    loader = px.shard(W.dataset(), batch_size=W.GLOBAL_BATCH, seed=7, rank=0, world_size=1)
    with pytest.warns(UserWarning, match="taken with 4 workers"):
        assert px.load_checkpoint(ckpt, model, opt, loader=loader)["step"] == W.SAVE_AT
    torch.testing.assert_close(W.flat(model), saved[0]["full"], rtol=0, atol=0)
    W.loop(model, opt, loader, W.SAVE_AT, W.STEPS)  # the optimizer's moments came back too: the run goes on exactly
    torch.testing.assert_close(W.flat(model), W.oracle(), rtol=1e-5, atol=1e-5)

    resumed = run_workers("workers.dcp:sharded", world_size=2, timeout=180, ckpt=ckpt, mesh=[2], load=True).results
    for r in resumed:  # 2 x 2 -> 1 x 2: resharded onto another mesh
        assert r["shards"]["0.weight"] == W.HIDDEN * W.IN // 2 and r["steps"] == W.STEPS
        torch.testing.assert_close(torch.cat([t.reshape(-1) for t in r["at_load"].values()]), saved[0]["full"],
                                   rtol=0, atol=0)
        torch.testing.assert_close(r["full"], W.oracle(), rtol=1e-5, atol=1e-5)


@pytest.mark.multiproc
def test_a_2x2_hsdp_checkpoint_resumes_on_1x3_and_on_3x1_equal_to_the_uninterrupted_run(hsdp_saved):
    ckpt, saved = hsdp_saved
    # one start of 3 workers, two resumes: 3 shards of one replica (FSDP), then 3 whole replicas (S = 1)
    runs = run_workers("workers.dcp:reloaded", world_size=3, timeout=180, ckpt=ckpt, meshes=[[1, 3], [3, 1]]).results
    for per_rank in runs:
        for r, held in zip(per_rank, (W.HIDDEN * W.IN // 3, W.HIDDEN * W.IN), strict=True):
            assert r["shards"]["0.weight"] == held and r["steps"] == W.STEPS
            torch.testing.assert_close(torch.cat([t.reshape(-1) for t in r["at_load"].values()]), saved[0]["full"],
                                       rtol=0, atol=0)
            torch.testing.assert_close(r["full"], W.oracle(), rtol=1e-5, atol=1e-5)


@pytest.mark.multiproc
def test_kill_9_during_an_asynchronous_save_leaves_the_previous_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    start = time.monotonic()
    run = run_workers("workers.dcp:killed", world_size=2, timeout=90, check=False, ckpt=ckpt)
    # every worker killed itself: the harness's own SIGKILL at its timeout would also read -9
    assert run.returncodes == [-9, -9] and time.monotonic() - start < 80, run.logs
    for r in (0, 1):
        held = torch.load(f"{ckpt}-held-{r}.pt", weights_only=True)
        assert held["done"] is False  # killed while its save was still being written...
        assert not torch.equal(held["trained"], torch.load(f"{ckpt}-weights-0.pt", weights_only=True))
    assert glob.glob(f"{ckpt}.tmp-*/partial-*")  # ...killed half-way through: part of it had reached the disk
    for r in (0, 1):  # each worker's writer process (which held the write) ended with its worker: no orphans
        writer = json.load(open(f"{ckpt}-held-{r}.json"))["writer"]
        until(lambda w=writer: launcher_gone(w), timeout=60, what=f"rank {r}'s writer process ending with it")
    model, opt = W._wrapped(99)
    with pytest.warns(UserWarning, match="taken with 2 workers"):
        assert px.load_checkpoint(ckpt, model, opt)["step"] == 2  # the previous checkpoint, whole
    torch.testing.assert_close(W.flat(model), torch.load(f"{ckpt}-weights-0.pt", weights_only=True), rtol=0, atol=0)
    assert not glob.glob(f"{ckpt}.tmp-*")  # the load removed what the killed save left (as the next save would)
    px.save_checkpoint(ckpt, model, opt, step=3)
    assert px.read_checkpoint(ckpt)["step"] == 3


def test_an_asynchronous_save_returns_a_handle_and_writes_the_state_of_the_moment_it_was_called(tmp_path):
    model, opt = W._wrapped(1)
    loader = px.shard(W.dataset(), batch_size=W.GLOBAL_BATCH, seed=7)
    W.loop(model, opt, loader, 0, 2)
    before = W.flat(model)
    handle = px.save_checkpoint(tmp_path / "c", model, opt, step=2, blocking=False)
    W.loop(model, opt, loader, 2, 4)  # the weights change while it is written: the staged copy is saved
    handle.wait()
    assert handle.done() and px.read_checkpoint(tmp_path / "c")["step"] == 2
    fresh, fresh_opt = W._wrapped(5)
    px.load_checkpoint(tmp_path / "c", fresh, fresh_opt)
    assert torch.equal(W.flat(fresh), before)


def test_phalanx_export_writes_a_state_dict_that_loads_into_the_plain_model(tmp_path, capsys):
    model, opt = W._wrapped(3)
    px.save_checkpoint(tmp_path / "c", model, opt, step=1)
    assert cli(["export", str(tmp_path / "c"), str(tmp_path / "model.pt")]) == 0
    assert "model.pt" in capsys.readouterr().out
    plain = W.net(seed=0)
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert torch.equal(W.flat(plain), W.flat(model))


def test_a_checkpoint_of_another_model_is_one_error_naming_the_keys_and_changes_nothing(tmp_path):
    model, opt = W._wrapped(3)
    px.save_checkpoint(tmp_path / "c", model, opt)
    other = torch.nn.Sequential(torch.nn.Linear(W.IN, W.HIDDEN + 1), torch.nn.Tanh(),
                                torch.nn.Linear(W.HIDDEN + 1, W.CLASSES), torch.nn.Linear(W.CLASSES, 2))
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(px.CheckpointError) as err:
        px.load_checkpoint(tmp_path / "c", other, torch.optim.AdamW(other.parameters()))
    text = str(err.value)
    assert "another model" in text and "\n" not in text
    assert "3.weight" in text and "0.weight (12, 6) vs (13, 6)" in text
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))


def test_bad_input_is_one_clear_line(tmp_path, capsys):
    model, opt = W._wrapped(3)
    px.save_checkpoint(tmp_path / "c", model, opt)
    assert cli(["export", str(tmp_path / "missing"), str(tmp_path / "m.pt")]) == 1
    assert "no checkpoint at" in capsys.readouterr().err
    os.remove(tmp_path / "c" / "phalanx.json")  # a directory whose save never finished
    with pytest.raises(px.CheckpointError, match="not a complete phalanx checkpoint"):
        px.load_checkpoint(tmp_path / "c", model, opt)
    assert not os.path.exists(tmp_path / "m.pt")


def test_dcp_metadata_that_would_run_code_is_refused(tmp_path):
    model, opt = W._wrapped(3)
    px.save_checkpoint(tmp_path / "c", model, opt)

    class Evil:
        def __reduce__(self):  # unpickling it would call os.system
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    with open(tmp_path / "c" / ".metadata", "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(px.CheckpointError, match=".metadata"):  # it no longer matches what the marker vouches for
        px.load_checkpoint(tmp_path / "c", model, opt)
    _reseal(tmp_path / "c", ".metadata")  # an editor who rewrote the marker too meets the unpickler
    with pytest.raises(px.CheckpointError, match="could not be read safely"):
        px.load_checkpoint(tmp_path / "c", model, opt)
    assert not os.path.exists(tmp_path / "ran")


def _reseal(path, name: str) -> None:
    """Rewrite the marker of the checkpoint ``path`` so that it vouches for the edited file ``name``."""
    import json
    from phalanx.sealed import digest_file, write_marker
    marker = json.loads((path / "phalanx.json").read_text())
    marker["files"][name] = digest_file(str(path), name)
    write_marker(str(path), {k: marker[k] for k in ("format", "world_size", "step")}, marker["files"])


def test_a_one_file_checkpoint_of_the_earlier_format_still_loads(tmp_path):
    from phalanx.checkpoint import FORMAT
    from phalanx.framing import write_verified
    from phalanx.checkpoint.training_state import TrainingState
    model, opt = W._wrapped(3)
    write_verified(tmp_path / "old.pt", {"format": FORMAT, "world_size": 1, "step": 5, "extra": {},
                                         "ranks": [TrainingState(model, opt, step=5).capture()]})
    fresh, fresh_opt = W._wrapped(4)
    assert px.load_checkpoint(tmp_path / "old.pt", fresh, fresh_opt)["step"] == 5
    assert torch.equal(W.flat(fresh), W.flat(model))
    assert cli(["export", str(tmp_path / "old.pt"), str(tmp_path / "m.pt")]) == 0
