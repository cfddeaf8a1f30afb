"""The latch a signal handler sets (phalanx.step.latch): it never waits on a lock its own thread holds.

The preemption handler and the parameter server's stop handler set one; before, they set a threading.Event, whose
set() hung the process for good when the signal came while the main thread was inside Event.wait() holding the
Event's lock. The test raises the signal at every traced line of a wait, in turn, so it lands inside each window.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from phalanx.step.latch import Latch

# In a child process: it installs its own handler and may hang (the old Event did, at the first window).
EVERY_LINE = r"""
import signal, sys, threading
from phalanx.step.latch import Latch

make = {"latch": Latch, "event": threading.Event}[sys.argv[1]]

def wait_with_signal_at(k):
    flag, seen = make(), [0]
    signal.signal(signal.SIGUSR1, lambda *_: flag.set())
    def tracer(frame, event, arg):  # every line of wait() and of what it calls
        if event == "line":
            seen[0] += 1
            if seen[0] == k:
                signal.raise_signal(signal.SIGUSR1)  # its handler runs at the next bytecode, inside this window
        return tracer
    sys.settrace(lambda *a: tracer)
    try:
        flag.wait(0)  # 0: returns at once, whatever the flag; the signal may land after its last check
    finally:
        sys.settrace(None)
    assert k == 0 or flag.is_set(), (k, seen[0])
    return seen[0]

lines, k = wait_with_signal_at(0), 1
while k <= lines:
    wait_with_signal_at(k)
    k += 1
print("windows", lines)
"""


def test_a_signal_at_any_line_of_a_wait_sets_the_latch_without_hanging():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", EVERY_LINE, "latch"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) >= 2  # the wait was traced: the signal landed inside it


def test_set_wakes_a_waiter_in_another_thread_and_every_later_wait():
    latch, woke = Latch(), threading.Event()
    waiter = threading.Thread(target=lambda: latch.wait(120) and woke.set())
    waiter.start()
    latch.set()
    waiter.join(120)
    assert woke.is_set() and latch.wait(0) and latch.wait(None)
    latch.close()
    assert latch.is_set() and latch.wait(0)  # closed: the flag still answers
    latch.set()  # and a late set() is harmless


def test_a_handler_sets_it_while_the_main_thread_is_blocked_in_wait():
    latch = Latch()
    old = signal.signal(signal.SIGUSR1, lambda *_: latch.set())
    try:
        sender = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGUSR1))
        sender.start()
        assert latch.wait(120)  # the main thread is in select() or past it; either way the byte or flag wakes it
        sender.join()
    finally:
        signal.signal(signal.SIGUSR1, old)
        latch.close()
