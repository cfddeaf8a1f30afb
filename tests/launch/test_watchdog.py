"""The launcher's step-progress watchdog (phalanx.launch.stacks.Watchdog), fed its clock by the test.

A real store and a real responder (this process, as worker "0"); worker "1" is a worker that published
steps and then stopped answering (as a SIGSTOPped one): its block says it gave no answer. The clock is
passed in, so a stall of seconds costs none.
"""
from __future__ import annotations

import io

import torch.distributed as dist

from phalanx.group import stacks
from phalanx.launch.stacks import FLOOR_S, Watchdog
from support.wait import until

SECRET = "s"


def _at(store, wid: str, step: int, progress: stacks.Progress | None) -> None:
    """Worker ``wid`` at ``step``: set where its responder publishes it (and wait for that), or straight in the store."""
    if progress is None:
        store.set(stacks.key("step", wid), str(step))
        return
    progress.step = step
    until(lambda: store.check([stacks.key("step", wid)]) and int(store.get(stacks.key("step", wid))) == step,
          timeout=60, what=f"worker {wid} publishes step {step}")


def test_a_stall_prints_every_workers_stacks_once_and_a_step_rearms_it():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mine = stacks.Progress()
    responder = stacks.Responder("127.0.0.1", store.port, SECRET, "0", lambda: (0, 0), mine).start()
    store.append(stacks.key("who"), "1\n")  # a worker that registered, then stopped answering
    out = io.StringIO()
    dog = Watchdog(store, SECRET, cap_s=30.0, out=out, answer_s=1.0)
    try:
        assert not dog.poll(now=0.0) and dog.bound() is None  # no step yet: a job still starting is never stuck
        for now, step in ((1.0, 10), (2.0, 20)):
            _at(store, "0", step, mine)
            _at(store, "1", step, None)
            assert not dog.poll(now=now)
        assert dog.step_time() == 0.1 and dog.bound() == FLOOR_S  # 20 x 0.1 s is below the floor
        _at(store, "0", 21, mine)  # worker 1 stays at step 20
        assert not dog.poll(now=2.0 + FLOOR_S - 0.5)
        assert dog.poll(now=2.0 + FLOOR_S + 0.5)
        text = out.getvalue()
        assert text.startswith("phalanx: stacks: the group has completed no step for 5.5 s (worker(s) 1 the longest")
        assert "----- rank 0 (worker 0, pid" in text and "test_a_stall_prints_every_workers_stacks" in text
        assert "----- worker 1: no answer within 1.0 s" in text and text.rstrip().endswith("phalanx: stacks: end")
        assert not dog.poll(now=2.0 + FLOOR_S + 5)  # once per stall
        dog.before_kill("1", "sent no heartbeat")  # this stall's stacks are printed already
        assert out.getvalue().count("phalanx: stacks: end") == 1
        _at(store, "1", 21, None)
        assert not dog.poll(now=20.0)  # it stepped: the wait starts over
        dog.before_kill("1", "sent no heartbeat for 10.0s (hung or stopped)")  # a new stall: stacks before the kill
        assert out.getvalue().count("phalanx: stacks: worker 1 sent no heartbeat for 10.0s (hung or stopped); "
                                    "before it is killed") == 1
        assert dog.end_note().startswith("phalanx: the group stalled 2 time(s) in this job")
    finally:
        responder.stop()


def test_the_bound_follows_the_step_time_up_to_the_cap_and_a_regroup_is_no_stall():
    dog = Watchdog(None, SECRET, cap_s=10.0)
    for now, step in ((0.0, 0), (2.0, 1), (4.0, 2)):
        dog.observe({"a": step, "b": step}, now)
    assert dog.step_time() == 2.0 and dog.bound() == 10.0  # 20 x 2 s, capped by the heartbeat timeout
    dog.observe({"a": 3, "b": 2}, 9.0)
    assert dog.stalled(15.0) == (11.0, ["b"])
    dog.reset(15.0)
    assert dog.stalled(16.0) == (1.0, ["a", "b"])
    dog.observe({"a": 3}, 16.0)  # b left the group: it no longer counts
    assert dog.stalled(17.0) == (2.0, ["a"])
