"""Liveness and failure reporting: heartbeats in the store, and who gets blamed when a worker dies.

Unit tests use a real TCPStore in this process and real heartbeat threads; the
multi-process tests start real workers (gloo) with no launcher, as torchrun or a
multi-host job would, and kill one with SIGKILL.
"""
from __future__ import annotations

import re
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from phalanx.group.liveness import (STALE_AFTER_S, Heartbeat, Liveness, Watch, alive_ranks, describe, record_exit,
                                    survey)
from support.procs import free_port, run_workers


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))


# -- unit: one process, real store, real threads ----------------------------------------------------------------

def test_a_beating_rank_is_alive_a_silent_one_stopped_and_a_note_says_how_one_exited(store):
    beats = [Heartbeat(store, rank, every_s=0.05).start() for rank in (0, 1)]
    beats[1].stop()  # rank 1 goes silent: it has beaten once, then stands still
    record_exit(store, 2, "ValueError: boom\nsecond line dropped")
    seen = survey(store, world_size=4, stale_after_s=0.5)
    beats[0].stop()
    assert seen == Liveness(alive=[0], exited={2: "ValueError: boom"}, stopped=[1, 3])
    assert seen.lost == [1, 2, 3]


def test_a_rank_blocked_in_a_long_store_wait_keeps_beating(store):
    # The heartbeat has its own connection: the main thread's blocking wait must not delay it.
    beat = Heartbeat(store, 0, every_s=0.05).start()
    reader = store.clone()  # another process's view

    released = []

    def wait_long() -> None:  # blocked in the store until the check below is done (released then, not timed out)
        store.wait(["released"], timedelta(seconds=30))
        released.append(True)

    waiter = threading.Thread(target=wait_long, daemon=True)
    waiter.start()
    try:
        assert alive_ranks(reader, world_size=1, stale_after_s=1.0) == [0]
        assert waiter.is_alive()  # the check ran while the main connection was blocked
    finally:
        reader.set("released", "1")
        waiter.join(timeout=30)
        beat.stop()
    assert released == [True]


def test_watch_counts_staleness_from_its_own_clock(store):
    beat = Heartbeat(store, 0, every_s=0.05).start()
    watch = Watch(store, world_size=2, stale_after_s=0.3)
    watch.poll()
    time.sleep(0.5)  # sleep: the Watch's own monotonic clock must pass stale_after_s (what is under test)
    watch.poll()
    beat.stop()
    assert watch.advanced() == [0] and watch.stale() == [1]


def test_diagnosis_names_only_ranks_that_are_gone_or_says_it_cannot_tell():
    assert describe(Liveness(alive=[0, 1, 2]), me=0).startswith("a peer, although every rank is still running")
    assert describe(Liveness(alive=[0], exited={1: "ok"}), me=0).startswith(
        "rank(s) 1 (rank 1 exited normally before this collective")
    assert "cannot tell which rank is gone" in describe(None, me=1)


# -- direct launch (no launcher): kill -9 one rank, never blame a live one ---------------------------------------

def blamed(message: str) -> set[int]:
    """The ranks a WorkerLostError message names as lost."""
    found = re.search(r"lost contact with rank\(s\) ([\d, ]+)", message)
    assert found, message
    return {int(r) for r in found.group(1).split(",")}


KILLS = [(3, 1, 2), (3, 2, 0), (4, 2, 3), (4, 1, 0)]  # (world_size, victim, slow)
# The kills' collective timeout, which a survivor whose collective waits on the busy rank (3-1-2: rank 0's all-reduce
# waits for rank 2, which is out of the collectives until rank 0 has its diagnosis) waits out before it diagnoses:
# derived from the heartbeat's stale time, as the diagnosis is (it then watches for STALE_AFTER_S more). Twice it:
# far above a step on a loaded machine (milliseconds; a thread starved a second or two), so no live rank's slowness
# can end a collective. (It was 20 s: 14 s of the job's 30 waited out for nothing.)
COLLECTIVE_S = 2 * STALE_AFTER_S


@pytest.fixture(scope="module")
def kills() -> dict[tuple[int, int, int], object]:
    """Each kill's run, the four jobs at once: each is its own group of forked workers on its own store, and
    mostly waits (a diagnosis, a heartbeat), so run one after the other they left the cores idle."""
    from concurrent.futures import ThreadPoolExecutor

    def one(case: tuple[int, int, int]):
        world_size, victim, slow = case
        return run_workers("workers.liveness:kill_one", world_size=world_size, check=False, timeout=90,
                           env={"PHALANX_TIMEOUT": str(COLLECTIVE_S)}, victim=victim, slow=slow)

    with ThreadPoolExecutor(len(KILLS)) as pool:
        return dict(zip(KILLS, pool.map(one, KILLS)))


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size, victim, slow", KILLS)
def test_killing_one_rank_blames_it_and_never_a_live_rank(kills, world_size, victim, slow):
    # `slow` is busy (not in a collective) when the victim dies, until every other survivor has its diagnosis:
    # longer than any check-in window (the old diagnosis waited 3 s for it, then blamed it).
    run = kills[(world_size, victim, slow)]
    assert run.returncodes[victim] == -9
    for rank in set(range(world_size)) - {victim}:
        assert run.returncodes[rank] == 0, run.log(rank)
        message = run.results[rank]["message"]
        assert message is not None and blamed(message) == {victim}, message
        assert "heartbeat stopped" in message, message
        assert run.results[rank]["lost_ranks"] == [victim]  # the error carries them: no one parses the message


@pytest.mark.multiproc
def test_a_collective_waiting_on_a_live_peer_ends_once_that_peer_is_noted_gone():
    """gloo fails a collective only when a socket closes: a peer that is noted gone (the elastic launcher's note for a
    worker it saw killed) while its sockets stay open must end the wait at once, not at the group's timeout (the
    60-minute chaos soak: one survivor waited 60 s in a gradient all-reduce)."""
    timeout_s = 60
    runs = [run_workers("workers.liveness:noted_while_a_peer_waits", world_size=2, timeout=150,
                        env={"PHALANX_TIMEOUT": str(timeout_s)}, synchronous=sync) for sync in (False, True)]
    for run in runs:
        got = run.results[0]
        assert got["message"] is not None and got["lost_ranks"] == [1], got
        assert "rank 1 raised KilledBySIGKILL" in got["message"], got["message"]
        assert got["after_s"] < 10, got  # a few watch periods; before: the whole timeout (60 s)
