"""The standby store's launcher side (issue 39 item 1), on real TCPStores on loopback, no processes.

What it copies and publishes, what it refuses, and what a take-over writes; the failover itself
(real hosts, real kills) is tests/elastic/test_store_failover.py.
"""
from __future__ import annotations

import gc
import json
import os
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from phalanx.elastic import secret
from phalanx.elastic.membership import Membership, key
from phalanx.elastic.worker import FAILOVER, read_standby
from phalanx.errors import ConfigError, PhalanxError
from phalanx.launch.elastic import listening_store
from phalanx.launch.join import check_secret
from phalanx.launch.standby import LAUNCHED, Standby, parse_standby

SECRET = "ab" * 32


@pytest.fixture
def primary():
    """A job's store as `phalanx run --elastic` leaves it: config with the secret's check, generation 1, launched."""
    store = listening_store("127.0.0.1")
    nonce = secret.nonce()
    store.set(key("config"), json.dumps({"min_workers": 1, "max_workers": 4, "heartbeat_s": 5.0, "workers": 2,
                                         "spares": [], "nonce": nonce, "check": secret.verifier(SECRET, nonce)}))
    store.set(key("gen", 0, "members"), json.dumps(["0", "1"]))
    store.set(key("gen", 1, "members"), json.dumps(["0", "1", "j1-0"]))
    store.set(key("gen"), "1")
    store.set(LAUNCHED, json.dumps(["0", "1"]))
    yield store


def test_the_standby_publishes_its_address_and_the_same_secret_admits_there(primary):
    standby = Standby("127.0.0.1", 0, primary)
    try:
        assert read_standby(primary) == ("127.0.0.1", standby.port)
        assert check_secret("127.0.0.1", standby.port, SECRET) == SECRET  # the job's secret, checked there
        with pytest.raises(PhalanxError, match="does not match"):
            check_secret("127.0.0.1", standby.port, "cd" * 32)
        with pytest.raises(PhalanxError, match="already has a standby store"):
            Standby("127.0.0.1", 0, primary)  # one per job
    finally:
        standby.close()


def test_closing_the_standby_closes_its_listening_socket_once(primary):
    """torch's store closes the socket it was handed when it goes; a second close by us took whatever file then had
    that number (a page's or a client's socket in the same process: EBADF at its own close, a clean-clone CI run)."""
    standby = Standby("127.0.0.1", 0, primary)
    port = standby.port
    standby.close()
    with open(os.devnull, "rb") as unrelated:  # the lowest free number: the socket's, if it was closed already
        del standby
        gc.collect()
        os.fstat(unrelated.fileno())  # still this file's: nobody closed it behind its back
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # and the port is free again


def test_a_take_over_marks_the_lost_launchers_workers_dead_and_the_survivors_regroup_there(primary):
    standby = Standby("127.0.0.1", 0, primary)
    try:
        store = standby.take_over({"j1-0"}, "127.0.0.1:1")
        assert store.check([FAILOVER]) and int(store.get(key("gen"))) == 1
        assert json.loads(store.get(key("gen", 1, "members"))) == ["0", "1", "j1-0"]
        assert store.check([key("dead", "0")]) and store.check([key("dead", "1")])
        assert not store.check([key("dead", "j1-0")])
        # the survivor, from its own generation and commits: the next generation forms there without the lost
        client = dist.TCPStore("127.0.0.1", standby.port, is_master=False, timeout=timedelta(seconds=5),
                               wait_for_workers=False)
        me = Membership(primary, "j1-0", ["0", "1", "j1-0"], generation=1)
        me.adopt(client)
        plan = me.next_generation([3, 6], timeout_s=5.0)
        assert plan == {"generation": 2, "members": ["j1-0"], "step": 6}
    finally:
        standby.close()


@pytest.mark.parametrize("given", ["", ":29400", "host:port", "10.0.0.2:70000"])
def test_a_malformed_standby_address_is_one_line(given):
    with pytest.raises(ConfigError, match="--standby-store") as err:
        parse_standby(given)
    assert "\n" not in str(err.value)


def test_after_a_take_over_a_returning_host_becomes_the_next_standby_and_a_second_loss_is_taken_over_too(primary):
    """Losing the standby after it took over need not end the job: a host that comes back with
    ``phalanx join --rdzv-endpoint <the standby> --standby-store ...`` is the job's next standby."""
    first = Standby("127.0.0.1", 0, primary)
    try:
        taken = first.take_over({"j1-0"}, "127.0.0.1:1")
        taken.set(LAUNCHED, json.dumps(["j1-0"]))  # as watch_joiners writes it once it took over
        taken.set(key("gen", 2, "members"), json.dumps(["j1-0", "j2-0"]))  # the returning host's worker, admitted
        taken.set(key("gen"), "2")
        client = dist.TCPStore("127.0.0.1", first.port, is_master=False, timeout=timedelta(seconds=5),
                               wait_for_workers=False)
        second = Standby("127.0.0.1", 0, client)  # the job's STANDBY key in the store that took over: empty
        try:
            assert read_standby(client) == ("127.0.0.1", second.port)  # where the workers read it (_beat)
            assert check_secret("127.0.0.1", second.port, SECRET) == SECRET
            assert second.generation == 2 and second.launched == ["j1-0"]
            store = second.take_over({"j2-0"}, first.address)
            assert store.check([FAILOVER]) and int(store.get(key("gen"))) == 2
            assert store.check([key("dead", "j1-0")]) and not store.check([key("dead", "j2-0")])
        finally:
            second.close()
    finally:
        first.close()


def test_join_status_to_a_job_started_without_status_is_one_line(primary, tmp_path, monkeypatch):
    """``phalanx join --status``: the page shows what the workers publish, which they do only under ``--status``."""
    from phalanx.launch import join
    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.setenv(secret.ENV, SECRET)
    with pytest.raises(ConfigError, match="started without --status") as err:
        join.main(["--rdzv-endpoint", f"127.0.0.1:{primary.port}", "--status", "0", str(script)])
    assert len(str(err.value).splitlines()) == 1


def test_the_page_follows_the_job_to_the_standby_keeping_what_it_showed(primary):
    from phalanx.launch.elastic import generation_members
    from phalanx.launch.status import JobStatus
    page = JobStatus.bind("127.0.0.1", 0)
    standby = Standby("127.0.0.1", 0, primary)
    try:
        # a client of the job's store, as `phalanx join` attaches its page
        client = dist.TCPStore("127.0.0.1", primary.port, is_master=False, timeout=timedelta(seconds=5),
                               wait_for_workers=False)
        page.attach(client, members=generation_members, secret=SECRET, announce=False)
        placeholder = lambda: ""  # noqa: E731 - the primary's stacks button, as it was
        page.action("stacks", placeholder)
        page.collector.poll()
        before = page.collector.status()
        assert before["generation"] == 1 and before["members"] == ["0", "1", "j1-0"]
        store = standby.take_over({"j1-0"}, "127.0.0.1:1")
        store.set(key("gen", 2, "members"), json.dumps(["j1-0"]))  # the survivor's regroup there
        store.set(key("gen"), "2")
        primary.set(key("gen"), "5")  # (the primary is read no more)
        page.follow(store, standby.host, standby.port)
        page.collector.poll()
        after = page.collector.status()
        assert after["generation"] == 2 and after["members"] == ["j1-0"]
        assert after["started"] == before["started"]  # the same page: its history kept
        assert page.server.actions["stacks"] is not placeholder  # it asks the standby's store now
    finally:
        page.end(0)
        standby.close()
