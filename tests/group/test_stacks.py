"""A worker's stacks, dumped by itself on a request through the store (phalanx.group.stacks), in one process.

The responder runs in this test's process as it runs in a worker: its own thread and store connection,
faulthandler on a signal it raises in itself. One thread spins in a Python loop, another waits inside a
store call (C++, without the GIL): both stacks name their line. Without the job's secret nothing is
answered, and what is answered crosses the store encrypted.
"""
from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from phalanx.errors import StacksRefused
from phalanx.group import stacks

SECRET = "the-job-secret"


def _line(tag: str) -> int:
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# {tag}"))


@pytest.fixture
def job():
    """A store, a responder for worker "0" on it, and two threads stuck in two ways until the test ends."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    progress = stacks.Progress()
    progress.step = 7
    responder = stacks.Responder("127.0.0.1", store.port, SECRET, "0", lambda: (0, 3), progress).start()
    done, spinning, waiting = threading.Event(), threading.Event(), threading.Event()
    blocker = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)

    def spin() -> None:
        while not (spinning.set() or done.is_set()): pass  # noqa: E701 # SPIN

    def wait_in_c() -> None:
        try:
            waiting.set() or blocker.wait(["never set"], timedelta(seconds=60))  # WAIT
        except dist.DistError:
            pass

    threads = [threading.Thread(target=spin, name="spinner"), threading.Thread(target=wait_in_c, name="waiter")]
    for t in threads:
        t.start()
    spinning.wait(30)
    waiting.wait(30)
    yield store
    done.set()
    store.set("never set", "now")
    for t in threads:
        t.join(30)
    responder.stop()


def test_a_worker_answers_while_one_thread_spins_in_python_and_another_waits_in_a_store_call(job):
    got = stacks.request_stacks(job, SECRET, timeout_s=60)
    answer = got["0"]
    assert (answer.rank, answer.generation, answer.step) == (0, 3, 7)
    assert f'line {_line("SPIN")} in spin' in answer.text, answer.text
    assert f'line {_line("WAIT")} in wait_in_c' in answer.text, answer.text
    assert "(spinner)" in answer.text and "(waiter)" in answer.text  # each thread named
    assert "phalanx-stacks" not in answer.text  # the dumping thread's own stack is left out
    assert "----- rank 0 (worker 0, pid" in stacks.blocks(got)[0]


def test_without_the_secret_nothing_is_answered_and_answers_cross_the_store_encrypted(job):
    with pytest.raises(StacksRefused):
        stacks.request_stacks(job, "a-guess", timeout_s=60)
    # a request written straight into the store, with a forged proof, then a real one: answered in order
    forged, real = "f" * 32, "a" * 32
    for nonce, mac in ((forged, "0" * 64), (real, stacks._ask_mac(SECRET, real))):
        job.append(stacks.key("asks"), json.dumps({"nonce": nonce, "mac": mac}) + "\n")
        job.add(stacks.key("asked"), 1)
    job.wait([stacks.key("answer", real, "0")], timedelta(seconds=60))
    assert not job.check([stacks.key("answer", forged, "0")])
    raw = job.get(stacks.key("answer", real, "0"))
    assert b"spin" not in raw and b"wait_in_c" not in raw
    assert stacks.unseal("a-guess", f"{real}/0", raw) is None
    assert "wait_in_c" in json.loads(stacks.unseal(SECRET, f"{real}/0", raw))["text"]


def test_a_sealed_answer_altered_in_the_store_is_refused():
    sealed = bytearray(stacks.seal(SECRET, "n/0", b"stacks"))
    sealed[-1] ^= 1
    assert stacks.unseal(SECRET, "n/0", bytes(sealed)) is None
    assert stacks.unseal(SECRET, "n/1", stacks.seal(SECRET, "n/0", b"stacks")) is None  # bound to request and worker


def test_a_worker_that_left_is_not_waited_for():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    responder = stacks.Responder("127.0.0.1", store.port, SECRET, "3", lambda: (1, 0)).start()
    assert stacks.responders(store) == ["3"]
    responder.stop()
    assert stacks.responders(store) == []
    assert stacks.request_stacks(store, SECRET, expect=["3"], timeout_s=600) == {"3": None}  # at once, not in 600 s
