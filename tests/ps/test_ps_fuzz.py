"""A live parameter-server process under random and adversarial frames.

Every frame goes over TCP to a real ``python -m phalanx.ps serve`` process, holding
the job's token, as a confused or hostile local process would. The server must answer
every request (so no handler thread died), change its shards only through the valid
pushes mixed in, and keep its memory bounded.
"""
from __future__ import annotations

import json
import random
import struct
import time

import pytest
import torch
import zmq

from phalanx.ps import start_servers
from phalanx.ps.wire import MAGIC, Header, pack_control, pack_header, unpack_header

TOKEN = b"fuzz-secret"
SHAPES = {"w": (64,), "b": (8,), "big": (256, 64)}
SGD1 = {"rule": {"kind": "sgd", "lr": 1.0}, "lock": True, "max_staleness": None}


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


class Peer:
    """A raw DEALER socket: sends any frames, waits (bounded) for the one reply."""

    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def reply(self, timeout_s: float = 10.0) -> dict:
        assert self.sock.poll(int(timeout_s * 1000)), "the server did not answer: a handler died or hangs"
        frames = self.sock.recv_multipart()
        return json.loads(frames[0])

    def ask(self, frames: list[bytes]) -> dict:
        self.send(frames)
        return self.reply()


def _tensor_frames(name: str, t: torch.Tensor, version: int = 0) -> list[bytes]:
    return [pack_header(Header.of(name, t, version)), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()]


def _raw_header(name: bytes, code: int, shape: tuple[int, ...], version: int = 0, name_len: int | None = None) -> bytes:
    n = len(name) if name_len is None else name_len
    return struct.pack("<4sBBHQH", MAGIC, code, len(shape), 0, version, n) + struct.pack(f"<{len(shape)}q", *shape) \
        + name


def _adversarial(rng: random.Random) -> list[bytes]:
    """One hostile or broken request (token included unless the case is about the token)."""
    kind = rng.randrange(16)
    op = rng.choice(["push", "easgd", "reduce", "set", "init", "pull", "bogus"])
    ctl = pack_control({"op": op, "id": rng.randrange(10**6), "alpha": 0.5, "step": rng.randrange(4),
                        "workers": 2, "names": ["w"], "policy": SGD1})
    name = rng.choice(list(SHAPES))
    if kind == 0:  # a header claiming 2^40 (or more) elements, data frame tiny
        dims = rng.choice([(2**40,), (2**20, 2**20), (2**62,), (1, 2**31, 16)])
        return [TOKEN, ctl, _raw_header(name.encode(), 1, dims), b"\0" * 16]
    if kind == 1:  # truncated header
        good = pack_header(Header(name, torch.float32, SHAPES[name]))
        return [TOKEN, ctl, good[:rng.randrange(len(good))], b"\0" * 4]
    if kind == 2:  # unknown dtype code, or a dtype other than the shard's
        code = rng.choice([0, 8, 99, 255, 2, 3, 5])
        return [TOKEN, ctl, _raw_header(name.encode(), code, SHAPES[name]), b"\0" * (8 * 64 * 256)]
    if kind == 3:  # wrong or weird names
        bad = rng.choice([b"nope", b"w\xff\xfe", b"x" * 1000, b"", b"w#sum", "\u00e9t\u00e9".encode()])
        return [TOKEN, ctl, _raw_header(bad, 1, (64,)), b"\0" * 256]
    if kind == 4:  # NaN or inf payloads to registered shards
        t = torch.randn(SHAPES[name])
        t.view(-1)[rng.randrange(t.numel())] = rng.choice([float("nan"), float("inf"), -float("inf")])
        return [TOKEN, pack_control({"op": rng.choice(["push", "easgd", "set", "init"]), "alpha": 0.5,
                                     "policy": SGD1}), *_tensor_frames(name, t)]
    if kind == 5:  # junk registrations: new names, up to 1 MB each
        n = rng.choice([1, 1000, 250_000])
        return [TOKEN, pack_control({"op": "init", "policy": SGD1, "seal": rng.random() < 0.5}),
                *_tensor_frames(f"junk{rng.randrange(10**9)}", torch.zeros(n))]
    if kind == 6:  # control frames that are not what they claim
        return [TOKEN, rng.choice([b"", b"\xff\xfe", b"[1,2]", b'{"op": 1}', b"{" * 5000, b'"push"', b"null",
                                   json.dumps({"op": "pull", "names": [1, 2]}).encode(),
                                   json.dumps({"op": "push", "lr": ["x"]}).encode()])]
    if kind == 7:  # a wrong or missing token
        return [rng.choice([b"", b"guess", TOKEN + b"x", b"\0" * 2000]), pack_control({"op": "info"})]
    if kind == 8:  # random frames
        return [TOKEN] + [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 6))]
    if kind == 9:  # a header without its data frame, or a data frame of the wrong size
        frames = _tensor_frames(name, torch.ones(SHAPES[name]))
        return [TOKEN, pack_control({"op": "push"}), frames[0]] + ([frames[1][:-4]] if rng.random() < 0.5 else [])
    if kind == 10:  # a shape that matches nothing registered under that name
        return [TOKEN, pack_control({"op": "push"}), *_tensor_frames(name, torch.ones(3, 3))]
    if kind == 11:  # reduce rounds with bogus bookkeeping
        return [TOKEN, pack_control({"op": "reduce", "step": rng.choice([-1, 2**70, "x", None, 1.5]),
                                     "workers": rng.choice([0, -3, 2**40, True, "2"])}),
                *_tensor_frames("b", torch.ones(8))]
    if kind == 12:  # bogus learning rates sent with a push
        return [TOKEN, pack_control({"op": "push", "lr": [rng.choice([float("nan"), -1.0, "0.1", None, 1e308 * 10])]}),
                *_tensor_frames("b", torch.ones(8))]
    if kind == 13:  # set with unknown state keys, or state without its value
        return [TOKEN, pack_control({"op": "set"}), *_tensor_frames(f"{name}#momentum", torch.ones(SHAPES[name]))]
    if kind == 14:  # the same shard twice in one request
        return [TOKEN, pack_control({"op": "push"}), *_tensor_frames("b", torch.ones(8)),
                *_tensor_frames("b", torch.ones(8))]
    return [TOKEN, pack_control({"op": "easgd", "alpha": rng.choice([float("nan"), 0, 1, 2, "x"])}),
            *_tensor_frames("b", torch.ones(8))]


@pytest.fixture(scope="module")
def server():
    with start_servers(1, token=TOKEN.decode(), round_timeout=1.0, max_message_mb=4) as group:
        yield group


def _pull(peer: Peer) -> dict[str, torch.Tensor]:
    peer.send([TOKEN, pack_control({"op": "pull", "names": list(SHAPES)})])
    assert peer.sock.poll(10_000)
    frames = peer.sock.recv_multipart()
    assert json.loads(frames[0])["ok"]
    return {unpack_header(frames[i]).name: torch.frombuffer(bytearray(frames[i + 1]), dtype=torch.float32)
            for i in range(1, len(frames), 2)}


def test_1200_adversarial_frames_leave_the_server_serving_and_its_state_changed_only_by_valid_pushes(server):
    ctx = zmq.Context()
    peer = Peer(ctx, server.addrs[0])
    values = {n: torch.randn(s) for n, s in SHAPES.items()}
    init = [f for n, v in values.items() for f in _tensor_frames(n, v)]
    assert peer.ask([TOKEN, pack_control({"op": "init", "policy": SGD1, "seal": True}), *init])["ok"]
    expected = {n: v.clone().view(-1) for n, v in values.items()}
    pid = server.procs[0].pid
    rss_before = _rss_kb(pid)
    rng = random.Random(0)
    valid = refused = 0
    for i in range(1200):
        if i % 10 == 0:  # a valid push, applied at lr 1 by the server's SGD
            name = rng.choice(list(SHAPES))
            g = torch.randn(SHAPES[name])
            reply = peer.ask([TOKEN, pack_control({"op": "push"}), *_tensor_frames(name, g)])
            assert reply["ok"], reply
            expected[name] -= g.view(-1)
            valid += 1
            continue
        reply = peer.ask(_adversarial(rng))
        refused += not reply.get("ok")
        # every refusal names its reason: nothing reached torch (allocation) or a generic handler first
        assert not reply.get("error", "").startswith(("malformed request", "internal error")), reply
    for _ in range(300):  # a flood: requests without waiting, then every answer
        peer.send(_adversarial(rng))
    for _ in range(300):
        peer.reply()
    big = Peer(ctx, server.addrs[0])  # a frame over the 4 MiB cap: that peer is dropped, nothing else
    big.send([TOKEN, pack_control({"op": "push"}), pack_header(Header("big", torch.float32, (2**21,))),
              b"\0" * 2**23])
    time.sleep(0.2)  # sleep: the server drops the big peer on another socket; nothing tells the test when
    got = _pull(peer)
    for name in SHAPES:  # only the valid pushes moved the shards
        assert torch.allclose(got[name], expected[name], atol=1e-5), name
    stats = peer.ask([TOKEN, pack_control({"op": "stats"})])
    assert stats["shards"] == len(SHAPES)  # no junk registration survived
    growth_mb = (_rss_kb(pid) - rss_before) / 1024
    print(f"{valid} valid pushes, {refused} refused of 1080 adversarial + 300 flooded; RSS growth {growth_mb:.1f} MB; "
          f"server counted {stats['rejected']} rejected, {stats['unauthorized']} unauthorized")
    assert refused >= 1000 and growth_mb < 64
    peer.sock.close(), big.sock.close(), ctx.term()


def test_an_abandoned_synchronous_round_is_dropped_and_its_worker_told(server):
    ctx = zmq.Context()
    peer = Peer(ctx, server.addrs[0])
    peer.send([TOKEN, pack_control({"op": "reduce", "step": 10**6, "workers": 2, "id": 1}),
               *_tensor_frames("b", torch.ones(8))])
    reply = peer.reply(timeout_s=15)  # the server's round timeout is 1 s here
    assert not reply["ok"] and "abandoned after 1 s: only 1 of 2 workers" in reply["error"], reply
    for step in range(20):  # open rounds are bounded: the 9th concurrent one is refused at once
        peer.send([TOKEN, pack_control({"op": "reduce", "step": 2 * 10**6 + step, "workers": 2, "id": 2}),
                   *_tensor_frames("b", torch.ones(8))])
    first = peer.reply()
    assert not first["ok"] and "rounds are already open" in first["error"], first
    peer.sock.close(), ctx.term()


@pytest.fixture
def fresh():
    """A server of its own, with one registered shard "v" (the module's server is sealed by another test)."""
    with start_servers(1, token=TOKEN.decode()) as group:
        ctx = zmq.Context()
        peer = Peer(ctx, group.addrs[0])
        assert peer.ask([TOKEN, pack_control({"op": "init", "policy": SGD1, "seal": True}),
                         *_tensor_frames("v", torch.ones(4))])["ok"]
        yield peer
        peer.sock.close(), ctx.term()


def _pull_v(peer: Peer) -> tuple[dict, torch.Tensor]:
    peer.send([TOKEN, pack_control({"op": "pull", "names": ["v"]})])
    assert peer.sock.poll(10_000), "the server did not answer the pull: the shard is silenced"
    frames = peer.sock.recv_multipart()
    reply = json.loads(frames[0])
    return reply, torch.frombuffer(bytearray(frames[2]), dtype=torch.float32) if reply["ok"] else None


def test_a_token_holder_cannot_silence_a_shard_with_the_largest_version(fresh):
    for version in (2**64 - 1, 2**63, 2**63 - 1):  # a set with a version at or past what travels, then a push
        raw = _raw_header(b"v", 1, (4,), version)
        reply = fresh.ask([TOKEN, pack_control({"op": "set"}), raw, torch.zeros(4).numpy().tobytes()])
        assert not reply["ok"] and "version" in reply["error"], reply
        fresh.ask([TOKEN, pack_control({"op": "push"}), *_tensor_frames("v", torch.ones(4))])
        reply, value = _pull_v(fresh)
        assert reply["ok"], reply
    assert torch.equal(value, torch.full((4,), -2.0))  # ones, then three pushes of ones at lr 1: every set refused
    with pytest.raises(Exception, match="version"):
        pack_header(Header("v", torch.float32, (4,), version=2**64))  # refused on the way out too, as a WireError


def test_an_update_whose_result_is_not_finite_is_refused_and_the_shard_stays(fresh):
    big = torch.full((4,), 1e10)  # finite, and so is lr: their product (1e40) is not, in float32
    reply = fresh.ask([TOKEN, pack_control({"op": "push", "lr": [1e30]}), *_tensor_frames("v", big)])
    assert not reply["ok"] and "result of this update of 'v' holds NaN or inf" in reply["error"], reply
    reply, value = _pull_v(fresh)
    assert reply["ok"] and torch.equal(value, torch.ones(4))  # untouched, and still served
