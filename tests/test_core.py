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
from phalanx.group import group
from phalanx.checkpoint import MAGIC
from phalanx.group.env import WorkerEnv
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
    import shutil
    path = tmp_path / "ckpt.pt"
    model = net(seed=2)
    opt = OPTIMIZERS["sgd"](model.parameters())
    px.save_checkpoint(path, model, opt, step=4)
    good = {name: (path / name).read_bytes() for name in os.listdir(path)}  # a checkpoint is a directory

    with pytest.raises(px.ConfigError, match="holds a value of type object"):  # refused before writing
        px.save_checkpoint(path, model, opt, step=5, extra={"oops": object()})
    with file_size_limit(max(map(len, good.values())) // 2), pytest.raises(px.CheckpointError) as full:
        px.save_checkpoint(path, model, opt, step=5)  # the disk fills up half-way
    assert str(path) in str(full.value) and "\n" not in str(full.value) and "File too large" in str(full.value)
    assert {name: (path / name).read_bytes() for name in os.listdir(path)} == good  # the previous one is as it was
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # and no temporary is left behind

    def damaged(name: str, part: str, change) -> str:  # noqa: ANN001
        bad = tmp_path / name
        shutil.copytree(path, bad)
        data = (bad / part).read_bytes()
        (bad / part).write_bytes(change(data))
        return str(bad)

    for bad in [damaged("truncated", "rank-0.pt", lambda d: d[: len(d) // 2]),
                damaged("flipped", "rank-0.pt", lambda d: d[:-10] + bytes([d[-10] ^ 0xFF]) + d[-9:]),
                damaged("truncated-data", "__0_0.distcp", lambda d: d[: len(d) // 2])]:
        fresh = net(seed=2)
        with pytest.raises(px.CheckpointError) as err:
            px.load_checkpoint(bad, fresh, OPTIMIZERS["sgd"](fresh.parameters()))
        assert "\n" not in str(err.value) and bad in str(err.value)
    (tmp_path / "foreign.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(px.CheckpointError, match="bad header"):
        px.load_checkpoint(tmp_path / "foreign.pt", net(seed=2), opt)
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
    from phalanx.group import group
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


# -- the Group: one owner of the run --------------------------------------------------------------------------------

def test_init_returns_the_group_and_the_module_functions_read_it():
    g = px.init()
    assert isinstance(g, px.Group) and g is px.current_group() and px.init() is g
    assert (g.rank, g.world_size, g.generation, g.elastic, g.lost_peers()) == (px.rank(), px.world_size(), 0, False, [])


def test_elastic_is_read_from_the_environment_once_into_the_group():
    from phalanx.group.env import WorkerEnv
    env = WorkerEnv.from_environ({"PHALANX_ELASTIC_ID": "3", "PHALANX_PS_ADDRS": "tcp://a:1,tcp://b:2"})
    g = group.Group(env, torch.device("cpu"))
    assert (g.elastic, env.elastic_id, env.ps_servers) == (True, "3", 2)
    assert not hasattr(group, "is_elastic")  # no call site reads the variable any more


def test_a_rebuild_must_go_to_a_later_generation():
    g = group.Group(WorkerEnv(), torch.device("cpu"))
    with pytest.raises(px.ConfigError, match="rebuild to generation 0; expected a generation after 0"):
        g.rebuild(0, 1, None, generation=0)


@pytest.mark.multiproc
def test_a_rebuilt_group_has_new_ranks_a_new_generation_its_subscribers_told_and_objects_cross_it():
    from support.procs import run_workers
    run = run_workers("workers.group:rebuild_and_objects", world_size=2)
    for rank, r in enumerate(run.results):
        assert r["init_is_current"] and r["rank_before"] == rank
        assert [(o["rank"], o["t"].tolist()) for o in r["all"]] == [(0, [0]), (1, [0, 1])]
        assert r["gather"] == ([[0, 0, 0], [1, 1, 1, 1]] if rank == 1 else None)
        assert r["bcast"]["from"] == 1 and r["bcast"]["t"].tolist() == [1.0, 1.0]
        # after the rebuild: ranks swapped, generation 1, the subscriber told once, collectives on the new group
        assert (r["rank_after"], r["module_rank"], r["generation"]) == (1 - rank, 1 - rank, 1)
        assert r["seen"] == [(1 - rank, 2, 1)]
        assert r["sum_after"] == 3.0 and r["all_after"] == [0, 1]
        assert min(r["beats_after"]) >= 1  # the one heartbeat moved to the new generation's store


@pytest.mark.multiproc
def test_lost_peers_names_a_rank_that_failed_without_any_collective():
    from support.procs import run_workers
    run = run_workers("workers.group:note_then_wait", world_size=2, check=False, timeout=90)
    assert run.returncodes[1] != 0 and run.returncodes[0] == 0, run.log(0)
    assert run.results[0]["after"] == [1]


# -- typed failures -------------------------------------------------------------------------------------------------

def test_a_failure_inside_a_guarded_collective_is_a_worker_lost_error_with_lost_ranks():
    from phalanx.group.guard import guarded
    with pytest.raises(px.WorkerLostError) as info:
        with guarded("a test collective"):
            raise RuntimeError("Connection reset by peer")
    assert info.value.lost_ranks == [] and "during a test collective" in str(info.value)
    with pytest.raises(TypeError):  # not a failure of the group: passes through as it is
        with guarded("a test collective"):
            raise TypeError("bad argument")


def test_elastic_reacts_to_the_type_of_a_failure_never_to_its_words():
    from phalanx.elastic.commits import is_peer_failure
    assert is_peer_failure(px.WorkerLostError("rank 1 is gone", lost_ranks=[1]))
    # A user's own error that happens to mention sockets and peers is the user's error: no rollback.
    assert not is_peer_failure(RuntimeError("my socket to the peer timed out; connection reset"))


def test_a_resize_cannot_be_swallowed_by_except_exception():
    from phalanx.elastic.commits import _Resize
    with pytest.raises(_Resize):
        try:
            raise _Resize(["j1"])
        except Exception:  # what a user's loop may wrap opt.step() in
            pass


# -- the strategy protocol ------------------------------------------------------------------------------------------

class _Counting(px.Exchange):
    def __init__(self) -> None:
        self.calls: list[int] = []

    def exchange(self, params, comm, step):
        self.calls.append(step)


def _pending_step(strategy):
    """Wrap a tiny model under ``strategy`` and leave step 1 pending: a backward with no optimizer step."""
    net = torch.nn.Linear(2, 1)
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=strategy)
    model(torch.ones(1, 2)).sum().backward()
    return model, opt


def test_reading_a_strategys_state_is_a_pure_read_and_settling_is_explicit():
    exchange = _Counting()
    strategy = px.Periodic(px.every(1), exchange)
    _pending_step(strategy)
    assert strategy.state_dict() == {"exchange": {}} and strategy.state_with_step()["step"] == 0
    assert exchange.calls == [] and strategy.clock.pending  # reading ran nothing
    strategy.settle()
    assert exchange.calls == [1] and strategy.state_with_step()["step"] == 1


def test_finish_closes_a_skipped_last_step_before_reconciling():
    exchange = _Counting()
    strategy = px.Periodic(px.every(2), exchange)
    _pending_step(strategy)
    strategy.finish()
    assert strategy.steps == 1 and exchange.calls == [1]  # the skipped step counts, so the last average runs


def test_a_checkpoint_closes_a_skipped_step_and_holds_the_framework_step(tmp_path):
    exchange = _Counting()
    strategy = px.Periodic(px.every(1), exchange)
    model, opt = _pending_step(strategy)
    px.save_checkpoint(tmp_path / "c.pt", model, opt)
    assert exchange.calls == [1]
    other = px.Periodic(px.every(1), _Counting())
    net = torch.nn.Linear(2, 1)
    model2, opt2 = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=other)
    px.load_checkpoint(tmp_path / "c.pt", model2, opt2)
    assert other.steps == 1


def test_a_rule_that_implements_no_capability_is_left_alone_by_every_feature():
    from phalanx.checkpoint.training_state import replica_state
    from phalanx.elastic.rule import CommitPoint, Regroupable
    from phalanx.step.protocols import replicas_agree, weighs_gradients
    from phalanx.strategies.accounting import bytes_sent
    strategy = px.Strategy()
    assert not isinstance(strategy, (Regroupable, CommitPoint))
    assert replicas_agree(strategy, 3) and not weighs_gradients(strategy, 1)
    assert replica_state(strategy) == {} and bytes_sent(strategy) == 0
    assert replicas_agree(px.Periodic(px.every(4), px.ParameterAverage()), 4)
    assert not replicas_agree(px.Periodic(px.every(4), px.ParameterAverage()), 3)


def test_a_strategy_that_uses_no_servers_warns_when_the_launcher_started_some():
    from phalanx.group.env import WorkerEnv
    from phalanx.wrap import tell_launch
    with pytest.warns(UserWarning, match="names 2 parameter servers"):
        tell_launch(px.AllReduce(), WorkerEnv(ps_servers=2))
