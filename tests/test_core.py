"""Core, in one process: sharding, a group of one, checkpoints, and every usage error's message."""
from __future__ import annotations

import contextlib
import os
import resource
import signal

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx.checkpoint import MAGIC
from phalanx.workerenv import WorkerEnv
from workers.core import OPTIMIZERS, dataset, flat, net, train


def one_clear_line(err: BaseException) -> str:
    """A usage error is one line that says what was given and what was expected."""
    msg = str(err)
    assert "\n" not in msg and "expected" in msg, msg
    return msg


# -- sharding -----------------------------------------------------------------------------------------------------

def epoch_of(n: int, world: int, batch: int, *, epoch: int = 0, seed: int = 0, shuffle: bool = True):
    """Each rank's batches for one epoch, as lists of sample indices, through the public loader."""
    data = torch.utils.data.TensorDataset(torch.arange(n))
    per_rank = []
    for rank in range(world):
        loader = px.shard(data, batch_size=batch, shuffle=shuffle, seed=seed, rank=rank, world_size=world)
        loader.set_epoch(epoch)
        per_rank.append([b[0].tolist() for b in loader])
        assert len(per_rank[-1]) == len(loader)
    return per_rank


@pytest.mark.parametrize("n,world,batch", [(10, 4, 1), (10, 4, 2), (10, 4, 3), (48, 2, 4), (7, 3, 2), (5, 5, 1)])
def test_every_sample_goes_to_exactly_one_worker_and_steps_are_equal(n, world, batch):
    per_rank = epoch_of(n, world, batch)
    seen = sorted(i for batches in per_rank for b in batches for i in b)
    assert seen == list(range(n))
    assert len({len(batches) for batches in per_rank}) == 1  # nobody waits at a collective the others skip
    assert len(per_rank[0]) == -(-n // (world * batch))  # as many steps as one process with batch world * batch
    assert all(max(map(len, step)) - min(map(len, step)) <= 1 for step in zip(*per_rank))  # near-equal parts


def test_short_last_batch_weights_each_part_by_its_share_and_the_weighted_mean_is_one_process_mean():
    data = torch.utils.data.TensorDataset(torch.arange(10.))
    weights, values = [], []
    for rank in range(4):  # 10 samples, 4 workers x batch 1: steps of 4, 4 and 2 (two workers get nothing)
        loader = px.shard(data, batch_size=1, seed=0, rank=rank, world_size=4)
        for step, (x,) in enumerate(loader):
            weights.append((step, rank, loader.batch_weight))
            values.append((step, rank, x))
    last = [(r, w) for s, r, w in weights if s == 2]
    assert last == [(0, 2.0), (1, 2.0), (2, 0.0), (3, 0.0)]
    for step in range(3):  # the mean over workers of weight x local mean == the mean over the global batch
        parts = [(w, x) for (s, _, w), (_, _, x) in zip(weights, values) if s == step]
        combined = sum(w * (x.mean() if len(x) else 0.0) for w, x in parts) / 4
        assert combined == pytest.approx(torch.cat([x for _, x in parts]).mean().item())
    empty = [x for s, r, x in values if s == 2 and r == 3][0]
    assert empty.shape == (0,) and empty.dtype == torch.float32  # an empty part keeps the sample's dtype


def test_order_differs_per_epoch_and_is_deterministic_given_the_seed():
    def order(epoch, seed):
        return [i for step in zip(*epoch_of(48, 2, 4, epoch=epoch, seed=seed), strict=True) for b in step for i in b]

    assert order(0, seed=3) == order(0, seed=3)
    assert order(0, seed=3) != order(1, seed=3)
    assert order(0, seed=3) != order(0, seed=4)
    assert order(0, seed=3) != list(range(48))


def test_n_workers_see_the_global_batches_of_one_process():
    # The property behind equivalence: 2 workers x batch 4 together see 1 process x batch 8, step by step.
    two = epoch_of(48, 2, 4, epoch=1, seed=5)
    one = epoch_of(48, 1, 8, epoch=1, seed=5)[0]
    assert [a + b for a, b in zip(*two, strict=True)] == one


def test_loader_resumes_mid_epoch_from_its_state():
    data = torch.utils.data.TensorDataset(torch.arange(40))
    loader = px.shard(data, batch_size=4, seed=1, rank=1, world_size=2)
    loader.set_epoch(2)
    full = [b[0].tolist() for b in loader]
    loader.set_epoch(2)
    it = iter(loader)
    head = [next(it)[0].tolist() for _ in range(2)]
    state = loader.state_dict()
    fresh = px.shard(data, batch_size=4, seed=1, rank=1, world_size=2)
    fresh.load_state_dict(state)
    fresh.set_epoch(2)  # the resumed loop calls set_epoch again; the position survives it
    assert head + [b[0].tolist() for b in fresh] == full


def test_loader_position_saved_by_2_workers_resumes_on_3_with_every_sample_once():
    data = torch.utils.data.TensorDataset(torch.arange(50))
    seen = []
    for rank in range(2):  # 2 workers x batch 4 take 3 steps of epoch 1, then the job is resized
        loader = px.shard(data, batch_size=4, seed=9, rank=rank, world_size=2)
        loader.set_epoch(1)
        it = iter(loader)
        seen += [i for _ in range(3) for i in next(it)[0].tolist()]
    state = loader.state_dict()
    assert state == {"epoch": 1, "seed": 9, "samples": 24, "n": 50}  # no world size in it
    steps = set()
    for rank in range(3):
        loader = px.shard(data, batch_size=4, seed=9, rank=rank, world_size=3)
        loader.load_state_dict(state)
        loader.set_epoch(1)
        rest = [b[0].tolist() for b in loader]
        steps.add(len(rest))
        seen += [i for b in rest for i in b]
    assert sorted(seen) == list(range(50)) and steps == {3}  # 26 left: global batches of 12, 12 and 2


def test_iterating_a_loader_leaves_the_global_rng_alone():
    loader = px.shard(dataset(), batch_size=8, seed=0)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    for _ in loader:
        pass
    assert torch.equal(torch.rand(3), expected)  # dropout after a resume draws what it would have drawn


# -- a group of one -----------------------------------------------------------------------------------------------

def test_group_of_one_is_plain_pytorch_bit_for_bit():
    px.init()
    assert (px.rank(), px.world_size(), px.is_main()) == (0, 1, True)
    plain = net(seed=5)
    plain_opt = OPTIMIZERS["sgd"](plain.parameters())
    for _ in range(2):
        for x, y in torch.utils.data.DataLoader(dataset(), batch_size=8, shuffle=False):
            plain_opt.zero_grad()
            F.cross_entropy(plain(x), y).backward()
            plain_opt.step()

    model = net(seed=5)
    model, opt = px.wrap(model, OPTIMIZERS["sgd"](model.parameters()))
    train(model, opt, px.shard(dataset(), batch_size=8, shuffle=False), epochs=2)
    assert px.unwrap(model) is model
    assert torch.equal(flat(model), flat(plain))


# -- checkpoints --------------------------------------------------------------------------------------------------

def test_px_save_writes_a_plain_state_dict(tmp_path):
    model = net(seed=2)
    px.save(model, tmp_path / "m.pt")
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    assert net(seed=3).load_state_dict(state)  # strict: no "module." prefixes
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Make writes beyond ``nbytes`` fail with EFBIG, as a full disk would, in this process only."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_damaged_checkpoint_is_refused_and_the_previous_one_is_untouched(tmp_path):
    path = tmp_path / "ckpt.pt"
    model = net(seed=2)
    opt = OPTIMIZERS["sgd"](model.parameters())
    px.save_checkpoint(path, model, opt, step=4)
    good = path.read_bytes()

    with pytest.raises(px.ConfigError, match="holds a value of type object"):  # refused before writing
        px.save_checkpoint(path, model, opt, step=5, extra={"oops": object()})
    with file_size_limit(len(good) // 2), pytest.raises(px.CheckpointError) as full:  # the disk fills up half-way
        px.save_checkpoint(path, model, opt, step=5)
    assert str(path) in str(full.value) and "\n" not in str(full.value) and "File too large" in str(full.value)
    assert path.read_bytes() == good  # the previous checkpoint is as it was
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # and no temporary file is left behind

    for name, data in [("truncated", good[: len(good) // 2]),
                       ("flipped", good[:-10] + bytes([good[-10] ^ 0xFF]) + good[-9:]),
                       ("foreign", b"not a checkpoint at all")]:
        bad = tmp_path / f"{name}.pt"
        bad.write_bytes(data)
        with pytest.raises(px.CheckpointError) as err:
            px.load_checkpoint(bad, net(seed=2), opt)
        assert "\n" not in str(err.value) and str(bad) in str(err.value)
    assert px.load_checkpoint(path, model, opt)["step"] == 4


def test_checkpoint_that_would_run_code_is_refused(tmp_path):
    import hashlib
    import io

    buf = io.BytesIO()
    torch.save({"model": nn.Linear(2, 2)}, buf)  # a pickled module: loading it would import and run code
    payload = buf.getvalue()
    (tmp_path / "evil.pt").write_bytes(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    with pytest.raises(px.CheckpointError, match="safely") as err:
        px.read_checkpoint(tmp_path / "evil.pt")
    assert "Linear" in str(err.value) and "weights_only" not in str(err.value)  # never advise turning safety off
    assert "\n" not in str(err.value)


def test_a_parameter_server_shard_file_given_to_load_checkpoint_is_named_as_such(tmp_path):
    from phalanx.framing import write_verified
    write_verified(tmp_path / "ps-shard-0.pt", {"format": "phalanx-ps-shards-1", "counts": {}, "shards": {}})
    with pytest.raises(px.CheckpointError) as err:
        px.load_checkpoint(tmp_path / "ps-shard-0.pt", net(seed=0))
    assert "parameter-server shard file" in one_clear_line(err.value)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    px.save_checkpoint(tmp_path / "c.pt", nn.Linear(3, 3))
    with pytest.raises(px.CheckpointError, match="another model"):
        px.load_checkpoint(tmp_path / "c.pt", net(seed=0))


# -- usage errors: one clear line each ----------------------------------------------------------------------------

def test_unknown_strategy():
    model = net(seed=0)
    with pytest.raises(px.ConfigError) as err:
        px.wrap(model, OPTIMIZERS["sgd"](model.parameters()), strategy="allreduse")
    assert "allreduse" in one_clear_line(err.value) and "allreduce" in str(err.value)


@pytest.mark.parametrize("batch", [0, -3, 2.5])
def test_batch_size_below_one(batch):
    with pytest.raises(px.ConfigError) as err:
        px.shard(dataset(), batch_size=batch)
    assert f"batch_size={batch}" in one_clear_line(err.value)


def test_model_without_trainable_parameters():
    frozen = net(seed=0).requires_grad_(False)
    with pytest.raises(px.ConfigError) as err:
        px.wrap(frozen, torch.optim.SGD(frozen.parameters(), lr=0.1))
    assert "no trainable parameters" in one_clear_line(err.value)


def test_dataset_smaller_than_the_number_of_workers():
    with pytest.raises(px.ConfigError) as err:
        px.shard(dataset(3), batch_size=1, rank=0, world_size=4)
    assert "3 samples for 4 workers" in one_clear_line(err.value)


@pytest.mark.parametrize("env,given", [
    ({"RANK": "0"}, "WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, "RANK is not"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "RANK=2 with WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one'"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "without MASTER_ADDR"),
])
def test_inconsistent_rank_and_world_size_variables(env, given):
    with pytest.raises(px.ConfigError) as err:
        WorkerEnv.from_environ(env)
    assert given in one_clear_line(err.value)


def test_environment_of_a_launched_worker_is_read_once():
    env = WorkerEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "123",
                                  "PHALANX_TIMEOUT": "7.5", "PHALANX_THREADS": "2"})
    assert (env.rank, env.world_size, env.local_rank, env.master_port, env.timeout_s, env.threads) == \
        (1, 2, 1, 123, 7.5, 2)
    with pytest.raises(px.ConfigError):
        WorkerEnv.from_environ({"PHALANX_TIMEOUT": "0"})


def test_more_nccl_workers_on_a_host_than_gpus_is_refused_before_anything_starts(monkeypatch):
    # NCCL itself fails only in the first collective, with an "invalid usage" that reads like a lost peer.
    from phalanx import group
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(group, "_group", None)
    with pytest.raises(px.ConfigError) as err:
        px.init()
    line = one_clear_line(err.value)
    assert "2 workers on this host on NCCL, with 1 GPU(s)" in line and "backend='gloo'" in line
