"""Parameter servers: placement, wire format, and the server's contract with real server processes.

Placement and wire tests start no process. The protocol tests talk to real
``python -m phalanx.ps.server`` processes over TCP on loopback.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq

import phalanx as px
from phalanx.errors import ConfigError
from phalanx.bench.models import mlp, resnet50
from phalanx.ps import Client, GreedyBytes, PSError, RoundRobin, Server, ServerUnreachable, imbalance, server_bytes
from phalanx.ps.placement import specs
from phalanx.ps.wire import Header, WireError, pack_header, recv_message, send_message, unpack_header
from support.procs import free_port

F32 = torch.float32


# -- placement ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, build", [("resnet50", resnet50), ("mlp", mlp)])
def test_greedy_bytes_balances_the_reference_models_within_10_percent(name, build):
    tensors = specs([(n, p) for n, p in build().named_parameters()])
    for servers in (2, 3, 4):
        greedy = imbalance(server_bytes(GreedyBytes().place(tensors, servers), servers))
        rr = imbalance(server_bytes(RoundRobin().place(tensors, servers), servers))
        print(f"{name}: {servers} servers, imbalance round_robin {rr:.3f}, greedy_bytes {greedy:.3f}")
        assert greedy <= 1.1


def test_greedy_pieces_cover_every_element_exactly_once():
    tensors = specs([(n, p) for n, p in mlp().named_parameters()])
    pieces = GreedyBytes().place(tensors, 3)
    for name, shape, _ in tensors:
        spans = sorted((p.start, p.stop) for p in pieces if p.var == name)
        assert spans[0][0] == 0 and spans[-1][1] == torch.Size(shape).numel()
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))


def test_round_robin_shows_the_lab_reports_failure_weights_on_one_server():
    pieces = RoundRobin().place(specs(list(mlp().named_parameters())), 2)
    assert {p.server for p in pieces if p.var.endswith("weight")} == {0}


# -- wire -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3, 4)])
def test_tensors_round_trip_bit_for_bit_with_their_header(dtype, shape):
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://wire")
    b.connect("inproc://wire")
    t = (torch.randn(shape) * 100).to(dtype)
    send_message(a, {"op": "x"}, [(Header.of("layer.w", t, version=2**40 + 3), t)], prefix=[b"tok"])
    msg = recv_message(b, prefix_frames=1)
    (header, got), = msg.tensors
    assert msg.prefix == [b"tok"] and msg.control == {"op": "x"}
    assert header == Header("layer.w", dtype, tuple(shape), 2**40 + 3)
    assert got.dtype == dtype and torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    a.close(), b.close(), ctx.term()


def test_malformed_frames_are_refused_never_reinterpreted():
    good = pack_header(Header("w", F32, (2, 2)))
    with pytest.raises(WireError, match="expected b'PXT1'"):
        unpack_header(b"XXXX" + good[4:])
    with pytest.raises(WireError, match="does not match"):
        unpack_header(good[:-1])
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://bad")
    b.connect("inproc://bad")
    a.send_multipart([b'{"op":"push"}', good, b"\0" * 12])  # the header promises 16 bytes
    with pytest.raises(WireError, match="12 bytes; header says 16"):
        recv_message(b)
    a.send_multipart([b"[1, 2]"])
    with pytest.raises(WireError, match="JSON object"):
        recv_message(b)
    a.send_multipart([b'{"op":"info"}'])  # the socket is still in step after the errors
    assert recv_message(b).control == {"op": "info"}
    a.close(), b.close(), ctx.term()


# -- a real server process -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("ps-shards"))


@pytest.fixture(scope="module")
def servers(servers_dir):
    """One server for the module, checkpointing its shard (the resume test reads it: one server start less)."""
    with px.ps.start_servers(1, token="job-secret", checkpoint_dir=servers_dir) as group:
        yield group


def _client(servers, token="job-secret", timeout=10.0) -> Client:
    return Client(servers.addrs, token=token, timeout=timeout)


def _register(client: Client, name: str, value: torch.Tensor, **policy) -> None:
    spec = {"rule": {"kind": "sgd", "lr": 1.0}, "lock": True, "max_staleness": None, **policy}
    client.call({0: ({"op": "init", "policy": spec}, [(Header.of(name, value), value)])})


def _pull(client: Client, *names: str) -> list[tuple[Header, torch.Tensor]]:
    return client.call({0: ({"op": "pull", "names": list(names)}, [])})[0].tensors


def test_bad_pushes_are_rejected_whole_and_change_nothing(servers):
    client = _client(servers)
    _register(client, "a", torch.zeros(2, 3))
    _register(client, "b", torch.zeros(4))
    before = _pull(client, "a", "b")
    good = (Header("b", F32, (4,), 0), torch.ones(4))
    bad = {"wrong shape": (Header("a", F32, (3, 2), 0), torch.ones(3, 2)),
           "wrong dtype": (Header("a", torch.float64, (2, 3), 0), torch.ones(2, 3, dtype=torch.float64)),
           "unknown variable": (Header("nope", F32, (4,), 0), torch.ones(4))}
    for what, tensor in bad.items():
        with pytest.raises(PSError, match="refused 'push'") as err:
            client.call({0: ({"op": "push"}, [good, tensor])})  # one good tensor in the same request
        print(what, "->", err.value)
    after = _pull(client, "a", "b")
    assert [(h, t.tolist()) for h, t in after] == [(h, t.tolist()) for h, t in before]
    client.close()


def test_a_wrong_or_missing_token_is_rejected_and_the_right_one_accepted(servers):
    for token in ("wrong-secret", None):
        client = _client(servers, token=token)
        with pytest.raises(PSError, match="requires the job's token"):
            client.broadcast({"op": "info"})
        client.close()
    client = _client(servers)
    assert client.broadcast({"op": "info"})[0].control["ok"]
    client.close()


def test_a_server_off_loopback_refuses_to_start_without_a_token():
    with pytest.raises(ConfigError, match="without a token"):
        Server("0.0.0.0")


def test_an_unreachable_server_gives_a_clear_error_within_the_timeout():
    addr = f"tcp://127.0.0.1:{free_port()}"  # nobody listens here
    client = Client([addr], timeout=1.0)
    start = time.monotonic()
    where = addr.removeprefix("tcp://")
    with pytest.raises(ServerUnreachable, match=rf"no answer from parameter server 0 \({where}\) within 1 s"):
        client.broadcast({"op": "info"})
    assert time.monotonic() - start < 10  # bounded: no hang
    client.close()


def test_pushes_staler_than_max_staleness_are_dropped_and_counted(servers):
    client = _client(servers)
    _register(client, "s", torch.zeros(3), max_staleness=0)
    push = {0: ({"op": "push"}, [(Header("s", F32, (3,), version=0), torch.ones(3))])}
    assert client.call(push)[0].control["dropped"] == []  # computed from version 0, applied: now version 1
    assert client.call(push)[0].control["dropped"] == ["s"]  # still from version 0: one version stale
    (header, value), = _pull(client, "s")
    assert header.version == 1 and value.tolist() == [-1.0, -1.0, -1.0]
    assert px.ps.load_report(servers).dropped_stale == [1]
    client.close()


def test_the_per_shard_lock_loses_no_concurrent_update(servers):
    _register(_client(servers), "locked", torch.zeros(1000), lock=True)
    pushes, workers = 50, 4

    def worker():
        client = _client(servers)
        for _ in range(pushes):
            client.call({0: ({"op": "push"}, [(Header("locked", F32, (1000,), 0), torch.ones(1000))])})
        client.close()

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (header, value), = _pull(_client(servers), "locked")
    assert header.version == pushes * workers
    assert torch.equal(value, torch.full((1000,), -float(pushes * workers)))


def test_servers_checkpoint_their_shards_and_a_new_job_resumes_from_them(servers, servers_dir):
    # the first job is the module's server (checkpointing to servers_dir); the new job is a server process of its own
    value, spec = torch.arange(4.0), {"rule": {"kind": "adagrad", "lr": 0.5}}
    client = Client(servers.addrs, token=servers.token, timeout=10)
    client.call({0: ({"op": "init", "policy": spec}, [(Header.of("w", value), value)])})
    client.call({0: ({"op": "push"}, [(Header("w", F32, (4,), 0), torch.ones(4))])})
    before, = _pull(client, "w")
    client.close()
    px.ps.save_shards(servers)  # on demand; stop() writes it again
    assert sorted(os.listdir(servers_dir)) == ["ps-shard-0.pt"]
    with px.ps.start_servers(1, checkpoint_dir=servers_dir) as group:  # a new job, resuming
        client = Client(group.addrs, token=group.token, timeout=10)
        after, = _pull(client, "w")
        client.call({0: ({"op": "push"}, [(Header("w", F32, (4,), 1), torch.ones(4))])})
        resumed, = _pull(client, "w")
        client.close()
    assert after[0].version == before[0].version == 1 and torch.equal(after[1], before[1])
    assert torch.allclose(resumed[1], before[1] - 0.5 / 2**0.5)  # Adagrad's sum came back: lr * g / sqrt(1 + 1)


def test_a_corrupted_shard_checkpoint_is_refused(tmp_path):
    path = tmp_path / "ps-shard-0.pt"
    server = Server(checkpoint=str(path)).start()
    server.store.init([(Header("w", F32, (2,)), torch.ones(2))], px.ps.Policy(px.ps.SGD(lr=0.1)))
    server.stop()
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(px.CheckpointError, match="truncated or corrupted"):
        Server(checkpoint=str(path))


def test_strategy_knobs_are_checked():
    with pytest.raises(ConfigError, match="every=0"):
        px.Downpour(push_every=0)
    with pytest.raises(ConfigError, match="max_staleness=-1"):
        px.Downpour(max_staleness=-1)
    with pytest.raises(ConfigError, match="alpha=1.5"):
        px.AsyncEASGD(alpha=1.5)
    with pytest.raises(ConfigError, match="server_optimizer"):
        px.Downpour(server_optimizer=torch.optim.SGD)
    with pytest.raises(ConfigError, match="only servers, placement and timeout"):
        px.ParameterServer(sync=True, push_every=2)
    with pytest.raises(ConfigError, match="placement="):
        px.Downpour(placement="random")
    assert isinstance(px.ParameterServer(sync=False), px.Downpour)


# -- Downpour follows the user's optimizer, or refuses ---------------------------------------------
def _two_groups(net: torch.nn.Module, opt_cls=torch.optim.SGD, **kw) -> torch.optim.Optimizer:
    return opt_cls([{"params": net[0].parameters(), "lr": 0.1}, {"params": net[2].parameters(), "lr": 0.03}], **kw)


def test_downpour_with_one_worker_follows_sgd_momentum_weight_decay_per_group_lrs_and_the_schedule():
    """One worker, push and pull every step: the servers' copy of the rule must be exactly torch's SGD."""
    kw = {"momentum": 0.9, "weight_decay": 1e-3, "nesterov": True}
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    net = copy.deepcopy(ref)
    ref_opt = _two_groups(ref, **kw)
    opt = _two_groups(net, **kw)
    strategy = px.Downpour()
    model, opt = px.wrap(net, opt, strategy=strategy)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (ref_opt, opt)]
    for step in range(7):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        for s in schedules:
            s.step()
    strategy.finish()
    assert max((a - b).abs().max().item() for a, b in zip(ref.parameters(), net.parameters(), strict=True)) <= 1e-6


@pytest.mark.parametrize("make, match", [
    (lambda net: torch.optim.Adam(net.parameters()), "Adam optimizer and no server_optimizer"),
    (lambda net: torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, dampening=0.5), "dampening=0.5"),
    (lambda net: torch.optim.SGD([{"params": net[0].parameters(), "momentum": 0.9}, {"params": net[2].parameters()}],
                                 lr=0.1), "param groups whose momentum/weight_decay/nesterov differ"),
])
def test_downpour_refuses_at_wrap_what_its_servers_cannot_apply(make, match):
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    with pytest.raises(ConfigError, match=match) as err:
        px.wrap(net, make(net), strategy=px.Downpour())
    assert "server_optimizer=px.ps.Adagrad" in str(err.value)  # and says what to do instead
    _, opt = px.wrap(net, make(net), strategy=px.Downpour(server_optimizer=px.ps.Adagrad(lr=0.1)))  # as it says
    px.strategy_of(opt).finish()


def test_import_phalanx_works_without_pyzmq_and_a_ps_strategy_says_what_to_install():
    code = ("import sys; sys.modules['zmq'] = None\n"
            "import phalanx as px\n"
            "try:\n    px.Downpour()\nexcept px.ConfigError as err:\n    print(err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install pyzmq (or phalanx[ps])" in out.stdout


def test_an_unused_server_group_is_named_at_wrap(monkeypatch):
    monkeypatch.setenv("PHALANX_PS_ADDRS", "tcp://127.0.0.1:5999")
    px.shutdown()  # the group reads the environment when it forms: leave one an earlier test formed
    net = torch.nn.Linear(2, 1)
    with pytest.warns(UserWarning, match="parameter servers .* but strategy AllReduce uses none"):
        px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=px.AllReduce())
